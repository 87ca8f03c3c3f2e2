"""A draft model of another vocabulary (another family: SmolLM2 drafting for Gemma), lossless: the `draft` method
takes this form when the draft's tokenizer differs from the target's (DraftModel.build).

The draft reads the target's text in its own tokens (spekit.proposers.vocab_bridge.Rows: only the new text is
encoded, with a few tokens of lookback) and its cache follows: where the text's draft tokens changed, the cache is
cut back to what still holds and the rest is fed. Then it drafts in its own vocabulary and hands the draft over
as target tokens, with the algorithms of Timor et al. (ICML 2025) for heterogeneous vocabularies:
- greedy (string-level exact match): the draft's text, encoded by the target's tokenizer, less its last token
  (which more text might merge into another); the target's greedy verification accepts the longest prefix equal
  to its own argmax chain, so the output is plain greedy's whatever the draft proposed;
- sampling (token-level intersection): the draft draws only among the tokens both vocabularies hold with the same
  bytes, from its processed distribution restricted to them, q; each drawn token is one target token, q is
  written over the target's vocabulary (zero elsewhere), and the exact rejection rule keeps the target's law
  for any such q.
Pacing as the same-vocabulary draft: the engine's pacer sizes each row's draft (in target tokens) from the
measured acceptance and the draft's share of the target's weights; no draft where none pays."""
from __future__ import annotations

import dataclasses

import torch

from ..sampling import argmax, row_sample, target_probs
from ..tree import DraftTree, chain
from .base import StepContext
from .draft_model import DraftModel
from .vocab_bridge import Rows, Shared, check_writable, piece_bytes


class CrossDraft(DraftModel):
    help = "speculative decoding with a draft model of another vocabulary"

    def __init__(self, target, options, draft, target_tokenizer, draft_tokenizer):
        super(DraftModel, self).__init__(target, options, draft)
        self.target_bytes = piece_bytes(target_tokenizer)[: target.vocab_size]
        self.draft_bytes = piece_bytes(draft_tokenizer)[: draft.vocab_size]
        self.target_bytes += [None] * (target.vocab_size - len(self.target_bytes))
        self.draft_bytes += [None] * (draft.vocab_size - len(self.draft_bytes))
        check_writable(self.target_bytes, draft_tokenizer, self.draft_bytes)
        self.tokenizers = (target_tokenizer, draft_tokenizer)
        self.shared = Shared(self.target_bytes, self.draft_bytes)

    def begin(self, ctx: StepContext, hidden=None) -> None:
        super().begin(ctx, hidden)
        self.rows = Rows(*self.tokenizers, self.target_bytes, self.draft_bytes)
        self.rows.add(len(ctx.tokens))
        self.cached: list[list[int]] = [[] for _ in ctx.tokens]      # the draft tokens in its cache, by position
        self.read = [0] * len(ctx.tokens)                            # target tokens the draft has followed

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        super().add_rows(ctx, hidden)
        self.rows.add(len(ctx.tokens))
        self.cached += [[] for _ in ctx.tokens]
        self.read += [0] * len(ctx.tokens)

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.rows.select(rows)
        self.cached = [self.cached[r] for r in rows]
        self.read = [self.read[r] for r in rows]

    def unread(self, tokens: list[list[int]]) -> list[int]:
        return [len(t) - r for t, r in zip(tokens, self.read)]

    def propose(self, ctx: StepContext) -> DraftTree | None:
        batch = len(ctx.tokens)
        want = ctx.budget.widths
        self.offered = [0] * batch
        if max(want) == 0:             # a plain step: the draft catches up when a row drafts again
            return None
        # what following the text took, the prompt's first reading included, is charged to this draft (the
        # pacer's reading cost per token, ChainPacer.observe): a draft of another family costs a fair share of a
        # target forward, so a catch-up after a pause is dear, and the pacer weighs it before ending a pause
        logits = self._follow([self.rows.sync(b, ctx.tokens[b]) for b in range(batch)])
        self.read = [len(t) for t in ctx.tokens]
        drafted, qs = self._draft(ctx, logits, want)
        return self._hand_over(ctx, drafted, qs, want)

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        """Nothing to cut now: the next draft cuts the cache back to the tokens of the text as it then is."""

    def _follow(self, texts: list[list[int]]) -> torch.Tensor:
        """Cut each row's cache back to the start it shares with its draft tokens `texts` (at least one token
        fed again, for its logits), feed the rest: the draft's logits after each row's last token [B, V]."""
        keep = []
        for b, ids in enumerate(texts):
            n, cached = 0, self.cached[b]
            most = min(len(cached), len(ids) - 1)
            while n < most and cached[n] == ids[n]:
                n += 1
            keep.append(n)
        self.kv.crop(keep)
        self.kv.compact()
        self.fed = keep
        logits = self._catch_up(texts)
        self.cached = [list(ids) for ids in texts]
        return logits

    def _draft(self, ctx: StepContext, logits: torch.Tensor, want: list[int]):
        """Up to want[b] + 1 draft tokens per row (greedy: one more, as the last is dropped at hand-over; a row
        stops at a token outside the text or below the confidence); their processed distributions under
        sampling. Every drawn token but each row's last goes into the draft's cache."""
        batch, cfg, device = len(want), ctx.cfg, self.draft.device
        limit = [w + 1 if cfg.greedy and w else w for w in want]
        drafted: list[list[int]] = [[] for _ in range(batch)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        active = [w > 0 for w in limit]
        eye = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)
        while any(active):
            toks = self._draw(logits, cfg, ctx.gens, active, qs)
            for b in range(batch):
                if not active[b]:
                    continue
                drafted[b].append(toks[b])
                if self.draft_bytes[toks[b]] is None or len(drafted[b]) >= limit[b]:
                    active[b] = False
                elif cfg.greedy and self._confidence[b] < self.options.confidence:
                    active[b] = False
            if not any(active):
                break
            feed = torch.tensor([toks[b] if active[b] else 0 for b in range(batch)], device=device)[:, None]
            pos = torch.where(torch.tensor(active, device=device), self.kv.next_positions(), -1)[:, None]
            logits = self.draft.forward(self.kv, feed, pos, eye)[0][:, -1]
            for b in range(batch):
                if active[b]:
                    self.cached[b].append(toks[b])
        return drafted, qs

    def _draw(self, logits: torch.Tensor, cfg, gens, active: list[bool], qs) -> list[int]:
        """One draft token per row from logits [B, V]: greedy the argmax (and its probability, kept for the
        confidence stop); sampling a draw from q, the processed distribution over the shared tokens."""
        if cfg.greedy:
            probs = logits.float().softmax(-1)
            self._confidence = probs.amax(-1).tolist()
            return argmax(logits.float()).tolist()
        # the row's temperature, top-k and top-p on the draft's own logits; its logit bias names target ids, so
        # it stays with the target (q only proposes: the rejection rule is exact for any q)
        own = dataclasses.replace(cfg, logit_bias=())
        q = target_probs(logits.float().masked_fill(self.shared.blocked.to(logits.device), float("-inf")), own,
                         None)
        out = []
        for b in range(q.shape[0]):
            if active[b]:
                out.append(int(row_sample(q[b:b + 1], gens[b:b + 1])))
                qs[b].append(q[b])
            else:
                out.append(0)
        return out

    def _hand_over(self, ctx: StepContext, drafted: list[list[int]], qs, want: list[int]) -> DraftTree:
        """The drafts as target-token chains (at most want[b] each), with q over the target's vocabulary."""
        batch, vocab = len(drafted), self.target.vocab_size
        if ctx.cfg.greedy:
            chains = [self.rows.to_target(d)[: w] for d, w in zip(drafted, want)]
        else:
            to_target = self.shared.to_target
            chains = [[int(to_target[t]) for t in d[: w]] for d, w in zip(drafted, want)]
        self.offered = [len(c) for c in chains]
        k = max(self.offered)
        device = ctx.pending.device
        tokens = torch.zeros(batch, k, dtype=torch.long, device=device)
        for b, c in enumerate(chains):
            tokens[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        q = None
        if not ctx.cfg.greedy:
            q = torch.zeros(batch, k, vocab, device=device)
            ids, into = self.shared.draft_ids, self.shared.target_ids.to(device)
            for b, c in enumerate(chains):         # summed: two draft tokens of the same bytes are one target token
                for j in range(len(c)):
                    q[b, j].index_add_(0, into, qs[b][j][ids].to(device))
        return chain(ctx.pending, tokens, torch.tensor(self.offered, device=device), q)
