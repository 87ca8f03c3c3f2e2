"""Per-sequence figures: tau, accepted-length histogram, per-position acceptance, timings."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceStats:
    """What one generated sequence cost. `tau` = new tokens / target forwards; the prefill counts as a forward
    (it yields the first token), so plain decoding has tau == 1 exactly. accept_hist and accept_lengths record
    what each verification gained, before a stop token or max_new_tokens cut the output."""

    new_tokens: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0                 # tokens the proposer offered (nodes of its trees)
    accept_hist: dict[int, int] = field(default_factory=dict)  # tokens gained per forward -> count
    position_offered: list[int] = field(default_factory=list)  # draft depth d (0-based) -> times offered
    position_accepted: list[int] = field(default_factory=list)  # draft depth d -> times accepted
    accept_lengths: list[int] = field(default_factory=list)     # tokens gained by each forward, in order
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    recording_s: float = 0.0              # of draft_s + verify_s: recording CUDA graphs (spekit.backends.cuda_graphs)
    lossless: bool = True                 # False: an opt-in lossy acceptance rule decided (not the target's law)

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def position_acceptance(self) -> list[float]:
        """Acceptance rate of the draft token at each depth, given that depth was offered."""
        return [a / o if o else 0.0 for a, o in zip(self.position_accepted, self.position_offered)]

    def record_times(self, draft_s: float, verify_s: float, recording_s: float) -> None:
        """One step's seconds drafting and verifying (recording_s: of both, recording CUDA graphs)."""
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.recording_s += recording_s

    def record_step(self, gained: int, offered_depth: int) -> None:
        """One target forward that gained `gained` tokens (accepted drafts + 1) after a draft `offered_depth` deep."""
        self.target_forwards += 1
        self.accept_lengths.append(gained)
        self.accept_hist[gained] = self.accept_hist.get(gained, 0) + 1
        while len(self.position_offered) < offered_depth:
            self.position_offered.append(0)
            self.position_accepted.append(0)
        for d in range(offered_depth):
            self.position_offered[d] += 1
            if d < gained - 1:
                self.position_accepted[d] += 1


@dataclass
class Result:
    """One generated sequence (one prompt, one sample)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str                    # "stop" (EOS / stop id / grammar complete) or "length"
    stats: SequenceStats
    logprobs: list | None = None          # TokenLogprob per token when the settings asked (spekit.logprobs)

    def as_dict(self) -> dict:
        s = self.stats
        return {
            "prompt_tokens": len(self.prompt_ids),
            "token_ids": self.token_ids,
            "new_tokens": s.new_tokens,
            "target_forwards": s.target_forwards,
            "mean_accepted": round(s.tau, 4),
            "accept_hist": {str(k): v for k, v in sorted(s.accept_hist.items())},
            "position_acceptance": [round(x, 4) for x in s.position_acceptance()],
            "wall_s": round(s.wall_s, 4),
            "tok_s": round(s.tok_s, 2),
            "draft_s": round(s.draft_s, 4),
            "verify_s": round(s.verify_s, 4),
            "recording_s": round(s.recording_s, 4),
            "finish_reason": self.finish_reason,
            "lossless": s.lossless,
            **({} if self.logprobs is None else {"logprobs": [lp.as_dict() for lp in self.logprobs]}),
        }
