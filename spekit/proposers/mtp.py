"""MTP drafting (DeepSeek-V3 multi-token prediction modules, `spekit.heads.mtp`): a chain of D modules drafts D
tokens from the target's last hidden state, each module feeding the next.

Where the modules come from: `--heads DIR` (trained with `spekit train mtp`); else the checkpoint's own MTP layers
(`num_nextn_predict_layers`, stored as layers num_hidden_layers.. in the DeepSeek-V3 layout); else modules shipped
with spekit for this model (spekit/data/heads/<model>/mtp).

The modules keep one KV cache (one layer per module) over the positions whose inputs are committed. Each step every
module runs over the positions not yet in that cache, the last of which (position p, the target's last one) drafts:
module k there reads the draft of module k-1. After the verdict, the slots whose inputs used a rejected draft are
dropped (module k's slot at position i used token i+k+1, so all modules keep positions up to p+1+accepted-D) and
recomputed next step. Drafts are sampled from the module's processed distribution q (soft, for exact sampling).

The depth per row adapts: each row keeps a running estimate of how often module k's draft is accepted given the
previous one was, and drafts the depth that gives the most tokens per unit of cost (the engine's measured cost of a
forward over d+1 tokens plus the modules' own cost, estimated from parameter counts), down to 0 (a plain step) when
drafting does not pay (never below --min-draft-tokens; set it to the ceiling for a fixed depth); estimates drift back
toward the prior while a row does not draft, so it tries again. A greedy generation starts from the estimates the
last one learnt on the same proposer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..sampling import draft_tokens, seen_of
from ..tree import DraftTree, chain
from ..backends.draft_vocab import ReducedHead
from .base import Proposer, StepContext, register

PRIOR_ACCEPT = 0.6      # acceptance estimate a row starts from (and drifts back to while it does not draft)
EMA = 0.2               # weight of the newest observation in the running estimates
# how fast a row that does not draft forgets its record: a module step (a decoder block and the full LM head) costs
# a sizeable share of a target forward, so a row whose drafts failed should wait a few dozen steps before it tries
# again (a fast drift brings it back above the paying line within a few steps, to fail again).
DRIFT = 0.01


@dataclass(frozen=True)
class MtpOptions:
    heads: str = ""                # head directory; "" = the model's own MTP layers, else the modules shipped for it
    max_draft_tokens: int = 0      # adaptive ceiling; 0 = as many as there are modules
    min_draft_tokens: int = 0      # adaptive floor; = the ceiling for a fixed depth (acceptance, not speed)
    head_context: int = 128        # most unseen committed tokens a catch-up feeds the modules, the latest (0 = all)

    def __post_init__(self) -> None:
        if self.head_context < 0:
            raise UserError(f"head_context must be >= 0 (0 = all), got {self.head_context}")
        if self.max_draft_tokens < 0 or self.min_draft_tokens < 0:
            raise UserError(f"draft token limits must be >= 0, got max {self.max_draft_tokens} and min "
                            f"{self.min_draft_tokens}")
        if self.max_draft_tokens and self.min_draft_tokens > self.max_draft_tokens:
            raise UserError(f"need min_draft_tokens <= max_draft_tokens, got {self.min_draft_tokens} and "
                            f"{self.max_draft_tokens}")


@register
class Mtp(Proposer):
    name = "mtp"
    Options = MtpOptions
    needs_hidden_states = True
    help = "DeepSeek-V3 multi-token prediction modules: the model's own, --heads DIR, or shipped ones"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        from ..backends.fast_forward import use_fast_linear
        from ..heads.mtp_native import find_modules
        self.head = find_modules(target, options.heads).to(dtype=target.dtype, device=target.device).eval()
        self.lm = self._draft_head(target)
        use_fast_linear(self.head)
        if self.lm is not target.model.get_output_embeddings():
            use_fast_linear(self.lm)                          # its own copy; the target's head is the target's
        self.modules = len(self.head.layers)
        self.cap = min(options.max_draft_tokens or self.modules, self.modules)
        self.layer = target.num_layers                       # hidden_states index: after the final norm
        self.module_cost = self._module_cost(target)

    def _draft_head(self, target) -> torch.nn.Module:
        """The LM head the modules draft through: the target's, or its rows for the modules' draft vocabulary
        (logits stay [..., V], -inf outside it)."""
        lm = target.model.get_output_embeddings()
        if not self.head.config.draft_vocab:
            return lm
        return ReducedHead(lm.weight.detach(), self.head.token_map, None if lm.bias is None else lm.bias.detach())

    def _module_cost(self, target) -> float:
        """One module step relative to a one-token target forward, by parameters read (CPU decoding is bound by
        memory traffic): a decoder block plus the LM head it drafts through, over the whole target."""
        block = sum(p.numel() for p in self.head.layers[0].parameters())
        head = sum(p.numel() for p in self.lm.parameters())
        return (block + head) / sum(p.numel() for p in target.model.parameters())

    def hidden_layers(self) -> tuple[int, ...]:
        return (self.layer,)

    def begin(self, ctx: StepContext, hidden=None) -> None:
        from ..cache import KVState
        h = hidden[self.layer]                                                 # [B, L, H] left-padded prompts
        self.kv = KVState(len(ctx.tokens), self.target.device, self.target.dtype)
        self.buf = [h[b, h.shape[1] - (len(t) - 1):] for b, t in enumerate(ctx.tokens)]   # positions fed.. p
        self.fed = [0] * len(ctx.tokens)
        # greedy: start from what the last greedy generation learnt (rows averaged), instead of probing modules
        # that rarely pay from the optimistic prior at every prompt; sampling: always the prior (seeds fix output)
        last = getattr(self, "alpha", None)
        start = [sum(col) / len(col) for col in zip(*last)] if ctx.cfg.greedy and last else \
            [PRIOR_ACCEPT] * self.modules
        self.alpha = [list(start) for _ in ctx.tokens]
        self.offered = [0] * len(ctx.tokens)

    def _depth(self, b: int, ctx: StepContext) -> int:
        top = min(self.cap, ctx.room[b])
        floor = min(self.options.min_draft_tokens, top)
        best, best_rate, reach, gain = floor, 0.0, 1.0, 1.0
        for d in range(0, top + 1):
            if d:
                reach *= self.alpha[b][d - 1]
                gain += reach
            rate = gain / (ctx.budget.row_cost(b)(d + 1) + d * self.module_cost)
            if d >= floor and rate > best_rate * (ctx.budget.margin if d > floor else 1.0):
                best, best_rate = d, rate
        return best

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> DraftTree:
        batch, device = len(ctx.tokens), self.target.device
        want = [self._depth(b, ctx) for b in range(batch)]
        self.offered, self.ran = want, max(want) > 0
        if not self.ran:
            empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
            return chain(ctx.pending, empty, torch.zeros(batch, dtype=torch.long, device=device))
        self._skip_old()
        counts = [len(x) for x in self.buf]
        width = max(counts)
        seq = torch.zeros(batch, width + self.modules, dtype=torch.long, device=device)
        hid = torch.zeros(batch, width, self.buf[0].shape[-1], dtype=self.buf[0].dtype, device=device)
        for b, (f, n) in enumerate(zip(self.fed, counts)):
            seq[b, :n] = torch.tensor(ctx.tokens[b][f + 1:f + 1 + n], device=device)   # the token after each
            hid[b, :n] = self.buf[b]
        n_t = torch.tensor(counts, device=device)
        offs = torch.arange(width, device=device)
        positions = torch.where(offs[None] < n_t[:, None], torch.tensor(self.fed, device=device)[:, None] + offs, -1)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None] & (positions >= 0)[:, None, :]
        mask = self.kv.attention_mask(positions, causal | torch.eye(width, dtype=torch.bool, device=device)[None])
        seen = seen_of(ctx.tokens, ctx.generated_from(), ctx.cfg, self.target.vocab_size, device)
        rows, last = torch.arange(batch, device=device), n_t - 1
        want_t = torch.tensor(want, device=device)
        drafts = torch.arange(self.modules, device=device)[None] < want_t[:, None]          # [B, D] row drafts k
        tokens, qs = [], []
        for k in range(self.modules):
            hid = self.head.step(k, self.target, seq[:, k:k + width], hid, positions, mask, self.kv.cache)
            if k >= max(want):
                continue                                    # later modules only keep their caches in step
            drawing = [b for b, w in enumerate(want) if w > k]             # who draws under sampling (host)
            tok, q, _ = draft_tokens(self.lm(hid[rows, last]), ctx.cfg, ctx.gens, seen,
                                      drawing)
            seq[rows, last + 1 + k] = tok
            tokens.append(tok)
            qs.append(q)
            if seen is not None:
                seen.add(rows, tok, drafts[:, k])
        self.kv.appended(positions)
        self.start, self.counts = self.kv.length - width, counts
        draft = torch.stack(tokens, dim=1)
        q = None if ctx.cfg.greedy else torch.stack(qs, dim=1)
        return chain(ctx.pending, draft, want_t, q)

    def _skip_old(self) -> None:
        """Keep of each row's unseen entries the latest `head_context` (as EAGLE's catch-up, `Eagle._skip_old`):
        the first catch-up over a long prompt runs every module over every token. The dropped entries count as
        fed, so positions stay the target's; the modules never attend to them."""
        window = self.options.head_context
        for b, h in enumerate(self.buf):
            if window and len(h) > window:
                self.fed[b] += len(h) - window
                self.buf[b] = h[len(h) - window:]

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        accepted = [len(g) - 1 for g in gained]
        h = hidden[self.layer]                                                 # [B, N, H] at the tree nodes
        if self.ran:
            keep = [min(n, max(0, n + a + 1 - self.modules)) for n, a in zip(self.counts, accepted)]
            width = max(self.counts)
            idx = torch.arange(width, device=self.target.device).expand(len(keep), width)
            self.kv.keep(self.start, idx, torch.tensor(keep, device=self.target.device))
            self.kv.compact()
        else:
            keep = [0] * len(accepted)
        path = verdict.path.tolist()
        for b, (a, m) in enumerate(zip(accepted, keep)):
            nodes = torch.tensor(path[b][:a + 1], device=h.device)
            self.buf[b] = torch.cat([self.buf[b][m:], h[b, nodes]])
            self.fed[b] += m
            self._learn(b, a)

    def _learn(self, b: int, accepted: int) -> None:
        """Update row b's acceptance estimates from a step that offered self.offered[b] tokens."""
        alpha = self.alpha[b]
        if self.offered[b] == 0:
            self.alpha[b] = [x + DRIFT * (PRIOR_ACCEPT - x) for x in alpha]
            return
        for k in range(min(accepted + 1, self.offered[b])):              # module k's draft was reached
            alpha[k] += EMA * (float(k < accepted) - alpha[k])

    def select_rows(self, rows: list[int]) -> None:
        self.kv.select_rows(torch.tensor(rows, device=self.target.device))
        self.buf = [self.buf[r] for r in rows]
        self.fed = [self.fed[r] for r in rows]
        self.alpha = [self.alpha[r] for r in rows]
        self.offered = [self.offered[r] for r in rows]
        if self.ran:
            self.counts = [self.counts[r] for r in rows]
