"""Self-speculative early exit (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023): draft with the
first E decoder layers of the target, its final norm and its LM head; the whole model verifies.

The draft runs on the target's own cache (`spekit.backends.decoder_layers.Scratch`): the KV of layers < E for every committed token
is the one the verification computed, so the draft needs no cache of its own and no catch-up forward, and for early
exit it is exactly what the first E layers would compute themselves. Its draft tokens are taken out of the cache
again before verification. (The verification recomputes layers < E for the drafted tokens: reusing them would need
a target forward that starts at layer E, which the HF forward does not offer; on a memory-bound CPU those layers
over k+1 tokens cost about what they cost over one.)

With `--heads DIR` (an exit adapter trained by `spekit train exit`, spekit.heads.exit) a small residual block
between layer E and the final norm maps the early hidden state towards the last one; the exit layer is the one it
was trained for.

Each row drafts a chain of up to k tokens, k adapting as in `draft` (all accepted: k += 2, else k -= 1), sampled
from the draft's processed distribution q under sampling (exact: q goes to the acceptance module). The width
drafted is the one that promises the most tokens per unit of cost, counting both the verification (`ctx.budget.cost`)
and the draft's own forwards (their share of the target's weights); where no width pays, the step is a plain one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..heads import load_head
from ..sampling import seen_of
from ..tree import DraftTree
from .base import Proposer, StepContext, register
from .chain_draw import ChainDraw
from .draft_model import check_lengths


@dataclass(frozen=True)
class EarlyExitOptions:
    exit_layer: int = 0            # draft with layers 0..exit_layer-1; 0 = half the model's layers
    num_draft_tokens: int = 4      # starting draft length per row
    max_draft_tokens: int = 8      # adaptive ceiling
    confidence: float = 0.3        # greedy: stop a row's draft when the draft's top probability is lower
    heads: str = ""                # early-exit: an exit adapter (`spekit train exit`); "" = none

    def __post_init__(self) -> None:
        if self.exit_layer < 0:
            raise UserError(f"exit_layer must be >= 1 (0 = half the layers), got {self.exit_layer}")
        check_lengths(self)


class SelfDraft(Proposer):
    """Drafts a chain with a subset of the target's layers (`self.draft_layers`), on the target's cache."""
    needs_target_layers = True

    def __init__(self, target, options, draft=None):
        from ..backends.decoder_layers import Stack
        super().__init__(target, options, draft)
        self.stack = Stack(target)
        self.adapter = self.load_adapter()
        self.draft_layers = self.stack.check_layers(self.choose_layers())
        self.step_cost = self.stack.relative_cost(self.draft_layers)   # one draft forward / one target forward

    def load_adapter(self):
        """A module between the last draft layer and the final norm, or None."""
        return None

    def choose_layers(self) -> list[int]:
        raise NotImplementedError

    def chain_pacing(self) -> tuple[int, int]:
        return self.options.num_draft_tokens, self.options.max_draft_tokens

    def draft_cost(self) -> float:
        return self.step_cost

    def propose(self, ctx: StepContext) -> DraftTree:
        assert ctx.kv is not None, "self-speculative drafting needs the target's cache"
        batch, device = len(ctx.tokens), ctx.pending.device
        want = ctx.budget.widths
        seen = seen_of(ctx.tokens, ctx.generated_from(), ctx.cfg, self.target.vocab_size, device)
        draw = ChainDraw(ctx, want, seen, self.options.confidence, device)
        tok, pos = ctx.pending, ctx.positions
        eye = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        from ..backends.decoder_layers import Scratch
        scratch = Scratch(self.stack, ctx.kv, self.draft_layers, self.adapter)
        try:
            while not draw.done:
                logits = scratch.step(tok[:, None], torch.where(draw.active, pos, -1)[:, None], eye)[:, -1]  # [B, V]
                tok = draw.draw(logits)
                pos = pos + 1
        finally:
            scratch.close()
        return draw.chain()[0]


@register
class EarlyExit(SelfDraft):
    name = "early-exit"
    Options = EarlyExitOptions
    help = "self-speculative: draft with the target's first --exit-layer layers, verify with all of them"

    def load_adapter(self):
        if not self.options.heads:
            return None
        head = load_head(self.options.heads, self.target, "exit").to(self.target.dtype)
        given, trained = self.options.exit_layer, head.config.exit_layer
        if given and given != trained:
            raise UserError(f"the exit adapter {self.options.heads} was trained for --exit-layer {trained}, not "
                            f"{given}")
        self.exit_layer = trained
        return head

    def choose_layers(self) -> list[int]:
        e = getattr(self, "exit_layer", None) or self.options.exit_layer or self.target.num_layers // 2
        n = self.target.num_layers
        if not 1 <= e <= n:     # e == n drafts with the whole model: pointless but exact (tests use it)
            raise UserError(f"exit_layer must be in 1..{n} for this model ({n} layers), got {e}")
        return list(range(e))
