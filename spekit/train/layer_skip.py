"""The training-free search for layer skipping (as SWIFT, Xia et al. 2024, does it: optimise the skipped set for the
draft's agreement with the full model on the user's own text), whose result the skip file keeps (`heads/skip_set.py`).

The full model writes greedy continuations of the user's prompts; every prompt + continuation is prefilled once.
A candidate set of kept layers is then scored *exactly* as the `layer-skip` proposer would draft on that text, in
one forward: a node group per start position t holds the next `depth` tokens of the text; each node sees the full
model's cache before t and the nodes of its group before it, so its draft prediction is the one the proposer would
make after a run of accepted tokens. The score is the tokens per unit of cost that the acceptance profile promises
(verification priced by the target's prior in `pacing.priors`, its precision on this CPU; each draft forward by the kept
weights' share).

Search: rank layers by what skipping each alone costs in agreement, skip them in that order while the score
improves, then try swapping a skipped layer for a kept one (random pairs, seeded) and keep what helps.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import UserError
from ..pacing.priors import PRIOR, prior_cost

if TYPE_CHECKING:      # not at run time: `spekit --help` builds this command's flags without transformers
    from ..cache import KVState
    from ..backends.decoder_layers import Stack
    from ..backends.torch_target import Target




@dataclass
class Evaluator:
    """Scores kept-layer sets on texts (prompt + the full model's greedy continuation)."""
    stack: Stack
    kv: KVState                # the full model's cache of every text
    tokens: torch.Tensor       # [B, N] node tokens
    positions: torch.Tensor    # [B, N]
    allowed: torch.Tensor      # [B, N, S+N]
    targets: torch.Tensor      # [B, G, D] the full model's next token after each node, -1 for padding groups
    depth: int

    @classmethod
    @torch.inference_mode()
    def build(cls, target: Target, texts: list[list[int]], starts: list[int], depth: int, per_text: int):
        from ..backends.decoder_layers import Stack
        kv = target.new_state(len(texts))
        target.prefill(kv, texts)
        groups = [list(range(s, len(t) - depth))[:: max(1, (len(t) - depth - s) // per_text)][:per_text]
                  for t, s in zip(texts, starts)]
        g = max(len(x) for x in groups)
        if g == 0:
            raise UserError("the texts are too short to search on")
        batch, n = len(texts), g * depth
        tokens = torch.zeros(batch, n, dtype=torch.long)
        positions = torch.full((batch, n), -1, dtype=torch.long)
        targets = torch.full((batch, g, depth), -1, dtype=torch.long)
        for b, (text, starts_b) in enumerate(zip(texts, groups)):
            for i, t in enumerate(starts_b):
                tokens[b, i * depth:(i + 1) * depth] = torch.tensor(text[t:t + depth])
                positions[b, i * depth:(i + 1) * depth] = torch.arange(t, t + depth)
                targets[b, i] = torch.tensor(text[t + 1:t + depth + 1])
        device = target.device
        tokens, positions, targets = tokens.to(device), positions.to(device), targets.to(device)
        start = positions.view(batch, g, depth)[:, :, :1].expand(-1, -1, depth).reshape(batch, n)   # [B, N]
        old = (kv.slot_pos[:, None, :] >= 0) & (kv.slot_pos[:, None, :] < start[:, :, None])
        node = torch.arange(n, device=device)
        same = (node[:, None] // depth == node[None, :] // depth) & (node[None, :] <= node[:, None])
        new = same[None] & (positions >= 0)[:, None, :] | torch.eye(n, dtype=torch.bool, device=device)[None]
        return cls(Stack(target), kv, tokens, positions, torch.cat([old, new], dim=2), targets, depth)

    @torch.inference_mode()
    def profile(self, kept: list[int]) -> list[float]:
        """P(the first j draft tokens are all accepted), j = 1..depth."""
        from ..backends.decoder_layers import Scratch
        scratch = Scratch(self.stack, self.kv, kept)
        try:
            logits = scratch.step(self.tokens, self.positions, self.allowed[..., -self.tokens.shape[1]:],
                                  self.allowed)
        finally:
            scratch.close()
        batch, g, d = self.targets.shape
        hit = (logits.argmax(-1).view(batch, g, d) == self.targets).long().cumprod(-1)   # [B, G, D]
        real = self.targets[..., 0] >= 0
        return (hit[real].float().mean(0)).tolist()

    def score(self, kept: list[int]) -> float:
        """Tokens per unit of cost at the best draft length (1.0 = plain decoding), with the verification costs of
        the target's prior (its precision on this CPU, as drafts are sized under sampling)."""
        return rate(self.profile(kept), self.stack.relative_cost(kept), self.stack.target.costs.prior)


def rate(profile: list[float], step_cost: float, table: dict[int, float] = PRIOR) -> float:
    """Tokens per unit of cost at the best draft length, 1.0 (plain decoding) when no length pays: a draft of k
    tokens costs k draft forwards of `step_cost` each and a verification over k + 1 tokens (the prior `table`)."""
    best, gain = 1.0, 1.0
    for k, p in enumerate(profile, start=1):
        gain += p
        best = max(best, gain / (prior_cost(k + 1, table=table) + k * step_cost))
    return best


def search(ev: Evaluator, trials: int = 40, seed: int = 0, log=None) -> tuple[list[int], float]:
    """The skipped layers with the best score, and that score."""
    n = ev.stack.num_layers
    everything = list(range(n))
    alone = {i: ev.profile([j for j in everything if j != i])[0] for i in everything}
    order = sorted(everything, key=lambda i: -alone[i])              # least harmful to skip first
    best_skip, best = [], 1.0
    for size in range(1, n):
        kept = sorted(set(everything) - set(order[:size]))
        profile, cost = ev.profile(kept), ev.stack.relative_cost(kept)
        score = rate(profile, cost, ev.stack.target.costs.prior)
        if log:
            log(f"skip {size:2d} layers: first draft token accepted {profile[0]:.2f}, a draft token costs "
                f"{cost:.2f} of a forward: score {score:.3f}")
        if score > best:
            best_skip, best = order[:size], score
        elif best_skip and size > len(best_skip) + 3:    # no early stop before anything pays: small skips never do
            break
    rng = random.Random(seed)
    for _ in range(trials if best_skip else 0):
        out, back = rng.choice(best_skip), rng.choice([i for i in everything if i not in best_skip])
        cand = [i for i in best_skip if i != out] + [back]
        score = ev.score(sorted(set(everything) - set(cand)))
        if score > best:
            best_skip, best = cand, score
            if log:
                log(f"swap {out} -> {back}: score {score:.3f}")
    return sorted(best_skip), best


