"""Log-probabilities of the tokens a step committed, read off the verification forward that decided them.

A committed token is predicted by one node of the tree the target verified: the root for the first token, the
accepted node before it for every later one. Those nodes' logits are the target's own at that place in the
text, so the log-probabilities here are the ones plain decoding would report: the same numbers bit for bit
where verification rows equal plain steps (spekit.backends.row_invariant), to float32 rounding elsewhere (tests show both).

They are raw: log_softmax of the target's logits, before logit bias, penalties, temperature, top-k, top-p or min-p
(as OpenAI reports them and vLLM does by default), so greedy and sampled runs report the model's distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None                     # None: nothing predicted it (the first token of a scored text)
    top: tuple[tuple[int, float], ...] = ()   # the most likely tokens at this place and theirs, most likely first

    def as_dict(self) -> dict:
        return {"token_id": self.token, "logprob": self.logprob,
                "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def committed(logits: torch.Tensor, nodes: list[list[int]], tokens: list[list[int]],
              tops: list[int | None]) -> list[list[TokenLogprob] | None]:
    """logits [B, N, V]: the target's raw logits at the N nodes of the step; nodes[b][i]: the node that predicted
    tokens[b][i]; tops[b]: how many top tokens row b wants, None where it wants no log-probabilities (then its
    entry is None and nothing is computed for it)."""
    out: list[list[TokenLogprob] | None] = []
    for b, top in enumerate(tops):
        if top is None or not tokens[b]:
            out.append(None if top is None else [])
            continue
        idx = torch.tensor(nodes[b], device=logits.device)
        lp = torch.log_softmax(logits[b, idx].float(), dim=-1)                  # [C, V]
        ids = torch.tensor(tokens[b], device=logits.device)
        chosen = lp.gather(1, ids[:, None])[:, 0].tolist()                     # [C]
        if top:
            values, which = lp.topk(top, dim=-1)                                # [C, top]
            pairs = [tuple(zip(w, v)) for w, v in zip(which.tolist(), values.tolist())]
        else:
            pairs = [()] * len(chosen)
        out.append([TokenLogprob(t, c, p) for t, c, p in zip(tokens[b], chosen, pairs)])
    return out


def of_text(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of a text the model read: logits [L, V] at its L positions (Target.score). Token i is
    predicted at position i - 1; the first token by nothing (logprob None)."""
    first = TokenLogprob(tokens[0], None)
    if len(tokens) < 2:
        return [first]
    return [first, *committed(logits[None], [list(range(len(tokens) - 1))], [tokens[1:]], [top])[0]]
