"""Classic speculative sampling with a smaller draft model of the same vocabulary (Leviathan et al. 2023,
Chen et al. 2023). The draft samples from its processed distribution q (soft probabilities, not argmax) with the
row's generator; the acceptance module compares q with the target's p.

The draft keeps its own KV cache of the committed tokens. Each row drafts up to k tokens, k adapting to what it
sees (all accepted: k += 2, else k -= 1, as transformers' assisted generation does), and only the length that
promises the most tokens per unit of cost (the engine's pacer sizes them, `pacing.chains.ChainPacer`: the
verification plus the draft's own forwards, each costing the draft's share of the target's weights, `draft_cost`); none where no length pays, and then the draft does no
work at all until a row drafts again. A greedy chain also stops early when the draft's top probability falls
below `confidence` (under sampling every draft token is drawn from q). Without the pacing every step would
draft at least one token whatever the acceptance, slower than plain where the draft is rarely accepted."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..sampling import seen_of
from ..tree import DraftTree
from .base import Proposer, StepContext, register
from .chain_draw import ChainDraw


@dataclass(frozen=True)
class DraftOptions:
    num_draft_tokens: int = 5      # starting draft length per row
    max_draft_tokens: int = 12     # adaptive ceiling
    confidence: float = 0.3        # greedy: stop a row's draft when the draft's top probability is lower

    def __post_init__(self) -> None:
        check_lengths(self)


def other_vocabulary(target, draft, tokenizer=None) -> bool:
    """Whether the draft's tokens are not the target's: another size, or (both tokenizers known) other token
    texts by id."""
    if draft.vocab_size != target.vocab_size:
        return True
    theirs = getattr(draft, "tokenizer", None)
    if tokenizer is None or theirs is None:
        return False
    return tokenizer.get_vocab() != theirs.get_vocab()


def check_lengths(o) -> None:
    """The draft-length options shared by the chain drafters (draft, early-exit, layer-skip)."""
    if not 1 <= o.num_draft_tokens <= o.max_draft_tokens:
        raise UserError("need 1 <= num_draft_tokens <= max_draft_tokens, got "
                        f"{o.num_draft_tokens} and {o.max_draft_tokens}")
    if not 0 <= o.confidence < 1:
        raise UserError(f"confidence must be in [0, 1), got {o.confidence}")


@register
class DraftModel(Proposer):
    name = "draft"
    Options = DraftOptions
    needs_draft_model = True
    help = ("speculative sampling with a smaller draft model (--draft), of the same vocabulary or of another "
            "(through the text)")

    @classmethod
    def build(cls, target, options, draft=None, tokenizer=None):
        """The same-vocabulary form, or CrossDraft when the draft's tokenizer differs from the target's."""
        if draft is None or not other_vocabulary(target, draft, tokenizer):
            return cls(target, options, draft)
        theirs = getattr(draft, "tokenizer", None)
        if tokenizer is None or theirs is None:
            raise UserError(f"the draft's vocabulary ({draft.vocab_size} tokens) is not the target's "
                            f"({target.vocab_size}) and {'the draft' if theirs is None else 'the target'} comes "
                            "without a tokenizer to bridge them: give a model folder or GGUF file with its tokenizer")
        if draft.weights_read() >= target.weights_read():
            raise UserError("the draft model is not smaller than the target: it would only slow decoding down "
                            "(give a smaller --draft)")
        from .cross_draft import CrossDraft
        return CrossDraft(target, options, draft, tokenizer, theirs)

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        if draft.vocab_size != target.vocab_size:
            raise UserError(f"the draft's vocabulary has {draft.vocab_size} tokens but the target's has "
                            f"{target.vocab_size}; give both tokenizers to draft across vocabularies")

    def begin(self, ctx: StepContext, hidden=None) -> None:
        if getattr(self, "kv", None) is not None:
            self.kv.release()                            # the last generation's: its buffers serve this one
        self.kv = self.draft.new_state(len(ctx.tokens))
        if ctx.kv is not None:                           # as many slots as the target's cache holds
            self.kv.reserve(ctx.kv.capacity)
        self.fed = [0] * len(ctx.tokens)                 # committed tokens in the draft's cache, per row

    def chain_pacing(self) -> tuple[int, int]:
        return self.options.num_draft_tokens, self.options.max_draft_tokens

    def draft_cost(self) -> float:
        """One draft forward relative to one target forward, by the weights each reads (Target.weights_read)."""
        return self.draft.weights_read() / self.target.weights_read()

    def unread(self, tokens: list[list[int]]) -> list[int]:
        return [len(t) - f for t, f in zip(tokens, self.fed)]

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        """New rows start with an empty draft cache (holes); the next propose feeds them their whole context."""
        self.kv.merge(self.draft.new_state(len(ctx.tokens)))
        self.fed += [0] * len(ctx.tokens)

    def propose(self, ctx: StepContext) -> DraftTree | None:
        batch, device = len(ctx.tokens), self.draft.device
        want = ctx.budget.widths
        self.offered = [0] * batch
        if max(want) == 0:             # a plain step: the draft catches up when a row drafts again
            return None
        logits = self._catch_up(ctx.tokens)                                    # [B, V]
        if self.first_feed:    # it read whole prompts, once per generation: not what a draft costs
            ctx.budget.measured = False
        seen = seen_of(ctx.tokens, ctx.generated_from(), ctx.cfg, logits.shape[-1], device)
        draw = ChainDraw(ctx, want, seen, self.options.confidence, device)
        eye = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        self.draft_start = self.kv.length
        while True:
            tok = draw.draw(logits)
            if draw.done:
                break
            pos = torch.where(draw.active, self.kv.next_positions(), -1)[:, None]
            logits = self.draft.forward(self.kv, tok[:, None], pos, eye)[0][:, -1]
        tree, self.offered = draw.chain()
        return tree

    def _catch_up(self, contexts: list[list[int]]) -> torch.Tensor:
        """Feed each row's committed tokens the draft has not seen (ragged, left-padded, so that every row's last
        one is in the last column) and return the draft's logits after each row's last one: [B, V]. Only that
        column goes through the LM head: the first catch-up covers whole prompts, and logits at every prompt
        position cost more than the rest of the draft's work on a long prompt."""
        todo = [c[f:] for c, f in zip(contexts, self.fed)]
        self.first_feed = not all(self.fed)
        width = max(len(t) for t in todo)
        device = self.draft.device
        tokens = torch.tensor([[0] * (width - len(t)) + t for t in todo], device=device)
        base = self.kv.next_positions()
        counts = torch.tensor([len(t) for t in todo], device=device)
        offs = torch.arange(width, device=device)[None] - (width - counts)[:, None]          # [B, W]
        pos = torch.where(offs >= 0, base[:, None] + offs, -1)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None] & (pos >= 0)[:, None, :]
        causal |= torch.eye(width, dtype=torch.bool, device=device)[None]
        logits = self.draft.forward(self.kv, tokens, pos, causal, last_only=True)[0]      # [B, 1, V]
        self.fed = [len(c) for c in contexts]
        return logits[:, -1]

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        if not any(self.offered):            # a plain step: the draft's cache did not move
            return
        accepted = [len(g) - 1 for g in gained]
        # the draft fed all but its last token; keep the slots of the accepted ones
        kept = [min(a, max(o - 1, 0)) for a, o in zip(accepted, self.offered)]
        m = max(kept) if kept else 0
        idx = torch.arange(m, device=self.draft.device).expand(len(kept), m)
        self.kv.keep(self.draft_start, idx, torch.tensor(kept, device=self.draft.device))
        self.kv.compact()
        self.fed = [f + k for f, k in zip(self.fed, kept)]

    def select_rows(self, rows: list[int]) -> None:
        self.kv.select_rows(torch.tensor(rows, device=self.draft.device))
        self.fed = [self.fed[r] for r in rows]
