"""EAGLE-1 / EAGLE-2 drafting (Li et al. 2024): a one-layer head that runs on the target's features drafts a tree,
which the core verifies in one target forward.

Each step the head first catches up on the committed tokens with the target's true features (gathered along the
accepted path), then drafts `depth` levels, one head forward per level over the whole frontier (tree attention
over its own small KV cache, dropped again after the step):
- `--tree dynamic` (EAGLE-2), greedy: the root's `branching` best children; at every level the `branching` best frontier nodes by
  cumulative draft log-probability get that many children each (stopping early when no path of the new level is
  min_prob likely); then the best nodes by that score are kept. How
  many (at most total_tokens) is decided per step from the scores (their sum estimates the tokens the step will
  gain, calibrated against what the steps gain) and the measured verification cost of each tree size.
- Under sampling (dynamic tree) each row grows one sampled chain, every level decided per row before it is
  drawn, never by the drawn token's own value (that would bias the draws; see `eagle_growth.Growth.sampled_chains`). Where
  siblings are drawn (the static tree) they are drawn without replacement (Gumbel top-k), so sibling j's q is the
  head's processed distribution with siblings 1..j-1 removed and renormalised: the core's recursive rejection
  rule is exact for that.
- `--tree static`: a fixed tree of paths of child ranks (EAGLE-1's, cut to the target's step costs).
- Under structured output, the text the row's grammar forces next (StepContext.forced) is grafted onto the tree as
  a chain of point masses after the head's nodes (`tree.graft`, exact under sampling as for eagle3-lookup); the
  head learns from its own nodes only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..heads import load_head
from ..heads.base import shipped_dir
from ..tree import DraftTree, roots, with_forced
from .base import Proposer, StepContext, register
from .eagle_growth import Growth, static_plan

STATIC_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0))


@dataclass(frozen=True)
class EagleOptions:
    heads: str = ""            # head directory; "" = the heads shipped for this model
    tree: str = "dynamic"      # dynamic (EAGLE-2) or static (a fixed tree of 17 nodes)
    depth: int = 6             # draft levels (dynamic tree)
    branching: int = 8         # children per expanded node and nodes expanded per level (dynamic tree)
    total_tokens: int = 24     # most draft nodes verified per step (dynamic tree)
    min_prob: float = 0.02     # greedy dynamic tree: stop drafting deeper when no path there is this likely
    head_context: int = 128    # most unseen committed tokens a catch-up feeds the head, the latest (0 = all)

    def __post_init__(self) -> None:
        if self.tree not in ("dynamic", "static"):
            raise UserError(f"tree must be 'dynamic' or 'static', got {self.tree!r}")
        if not 0 <= self.min_prob < 1:
            raise UserError(f"min_prob must be in [0, 1), got {self.min_prob}")
        if self.head_context < 0:
            raise UserError(f"head_context must be >= 0 (0 = all), got {self.head_context}")
        for name in ("depth", "branching", "total_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")


def find_heads(option: str, kind: str, target) -> str:
    """The head directory to load: the user's, or the shipped one made for a model of this shape."""
    if option:
        return option
    found = shipped_dir(kind, target)
    if found is not None:
        return str(found)
    raise UserError(f"no {kind} heads ship for this model; train them with `spekit train {kind}` and pass "
                    f"--heads DIR")


@register
class Eagle(Proposer):
    name = "eagle"
    kind = "eagle"
    Options = EagleOptions
    needs_hidden_states = True
    help = "EAGLE-1/2: a one-layer head on the target's features drafts a tree (--heads DIR, --tree dynamic|static)"
    grafts_forced = True           # graft the grammar's forced text onto the head's tree (see the module's doc)
    paced_trees = True             # rests, calibrated chances, drafting overhead: ctx.budget.trees

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        self.head = load_head(find_heads(options.heads, self.kind, target), target, self.kind).to(target.dtype)
        levels = len(STATIC_TREE[-1]) if options.tree == "static" else options.depth
        nodes = len(STATIC_TREE) if options.tree == "static" else options.total_tokens
        if levels + 2 > target.max_positions or nodes + 1 > target.max_positions:
            raise UserError(f"a draft tree of {nodes} nodes and depth {levels} does not fit the model's context "
                            f"of {target.max_positions} tokens")
        self.embed = target.model.get_input_embeddings()
        self.level_cost = _level_cost(self.head, target)   # one head forward, relative to a target forward
        self.fed: int | None = None     # draft levels the head fed this step (dynamic greedy tree), else None
        self.static_plan = static_plan(STATIC_TREE, target.device) if options.tree == "static" else None
        self.own_size = 0               # the head's tree size this step (nodes from it on were grafted)

    # --- committed context ------------------------------------------------------------------------------------

    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.head.feature_layers())

    def begin(self, ctx: StepContext, hidden=None) -> None:
        feats = self.head.features(hidden)                                     # [B, L, F] left-padded
        batch, longest = feats.shape[:2]
        lengths = torch.tensor([len(t) - 1 for t in ctx.tokens], device=feats.device)
        idx = (longest - lengths)[:, None] + torch.arange(longest, device=feats.device)[None]
        self.todo_feats = feats.gather(1, idx.clamp(max=longest - 1)[..., None].expand(-1, -1, feats.shape[2]))
        self.todo_tokens = [t[1:] for t in ctx.tokens]
        from ..cache import KVState
        self.kv = KVState(batch, self.target.device, self.target.dtype)
        self.skipped = torch.zeros(batch, dtype=torch.long, device=feats.device)   # [B] entries never fed
        self.resting = False

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        feats = self.head.features(hidden)                                     # [B, N, F]
        path = verdict.path.clamp(min=0)                                       # [B, D+1]
        feats = feats.gather(1, path[..., None].expand(-1, -1, feats.shape[2]))
        if self.resting:               # the head has not seen the last steps' entries: keep them for its catch-up
            self.todo_feats = _cat_rows(self.todo_feats, self.todo_tokens, feats, gained)
            self.todo_tokens = [t + list(g) for t, g in zip(self.todo_tokens, gained)]
            return
        self.todo_feats = feats
        self.todo_tokens = [list(g) for g in gained]
        if not ctx.cfg.greedy and self.options.tree != "static":
            for row, got in zip(ctx.budget.trees.rows, self._credits(verdict, gained)):
                row.learn(got)
        elif ctx.budget.trees.batch.chance is not None:
            ctx.budget.trees.batch.learn(sum(self._credits(verdict, gained)))
            # what drafting cost beyond its levels' weights, by the clock (on a GPU whose host launches each of the
            # head's small kernels, many times what the weights say). Charged to every later tree (`_size`) whole,
            # not divided among the levels: much of it does not grow with the depth, and dividing it would make
            # the trees shallower than they pay
            levels = None if self.fed is None else (1 + self.fed) * self.level_cost
            ctx.budget.trees.overhead.observe(ctx.budget.spent(), levels)

    def _credits(self, verdict, gained: list[list[int]]) -> list[int]:
        """Per row, the draft tokens the head's own tree got accepted this step (the path's nodes below
        own_size: grafted nodes come after the head's)."""
        path = verdict.path[:, 1:]                                     # [B, D]
        return ((path >= 0) & (path < self.own_size)).sum(1).tolist()

    def select_rows(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, device=self.target.device)
        self.kv.select_rows(idx)
        self.todo_feats = self.todo_feats[idx]
        self.todo_tokens = [self.todo_tokens[r] for r in rows]
        self.skipped = self.skipped[idx]

    @torch.inference_mode()
    def _catch_up(self):
        """Feed the committed entries the head has not seen. Returns its output and logits at each row's last
        entry (the one that drafts the pending token's children): ([B, H], [B, Vd])."""
        self._skip_old()
        counts = torch.tensor([len(t) for t in self.todo_tokens], device=self.target.device)
        width = int(counts.max())
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in self.todo_tokens], device=self.target.device)
        offs = torch.arange(width, device=counts.device)
        real = offs[None] < counts[:, None]
        pos = torch.where(real, (self.kv.next_positions() + self.skipped)[:, None] + offs[None], -1)
        causal = torch.ones(width, width, dtype=torch.bool, device=counts.device).tril()[None] & real[:, None, :]
        causal |= torch.eye(width, dtype=torch.bool, device=counts.device)[None]
        feats = self.todo_feats[:, :width].to(self.target.dtype)
        out = self.head.step(self.embed(tokens), self.head.project(feats), pos,
                             self.kv.attention_mask(pos, causal), self.kv.cache)
        self.kv.appended(pos)
        last = out[torch.arange(len(counts), device=counts.device), counts - 1]           # [B, H]
        return last, self.head.draft_logits(last[:, None], self.target)[:, 0]

    def _skip_old(self) -> None:
        """Keep of each row's unseen entries the latest `head_context`. The first catch-up over a long prompt (one
        head layer over every token) cost as much as one or two target forwards, paid again by every answer
        whether or not the head then pays: on Spec-Bench's 600-770-token summarization prompts 35-52 ms, 1-2% of
        a 64-token answer, which put `eagle3` below plain there. The entries dropped keep their positions (the
        head's rotary positions stay the target's); the head just never attends to them."""
        window = self.options.head_context
        drop = [max(0, len(t) - window) for t in self.todo_tokens] if window else []
        if not any(drop):
            return
        keep = max(len(t) - d for t, d in zip(self.todo_tokens, drop))
        device = self.todo_feats.device
        idx = (torch.tensor(drop, device=device)[:, None] + torch.arange(keep, device=device)).clamp(
            max=self.todo_feats.shape[1] - 1)                                            # [B, keep]
        self.todo_feats = self.todo_feats.gather(1, idx[..., None].expand(-1, -1, self.todo_feats.shape[2]))
        self.todo_tokens = [t[d:] for t, d in zip(self.todo_tokens, drop)]
        self.skipped += torch.tensor(drop, device=self.skipped.device)

    # --- drafting ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> DraftTree:
        tree = self._head_tree(ctx)
        self.own_size = tree.size
        return with_forced(tree, ctx.forced) if self.grafts_forced else tree

    def _head_tree(self, ctx: StepContext) -> DraftTree:
        self.fed = None
        held = max(ctx.room) == 0           # no room to draft (the context's end, or the engine's governor)
        if not ctx.cfg.greedy and self.options.tree != "static":
            allowed = [row.ready() and room > 0 for row, room in zip(ctx.budget.trees.rows, ctx.room)]
            self.resting = not any(allowed)
        else:
            allowed = None
            self.resting = not ctx.budget.trees.batch.ready() or held
        if self.resting:               # drafting did not pay lately: a plain step, the head does no work
            return roots(ctx.pending)
        root_out, root_logits = self._catch_up()
        base = self.kv.length
        grow = Growth(self, ctx, root_out, base)
        if self.options.tree == "static":
            tree = grow.static(root_logits, self.static_plan)
        elif ctx.cfg.greedy:
            tree = grow.dynamic_greedy(root_logits)
        else:
            tree = grow.sampled_chains(root_logits, allowed)
        ctx.budget.trees.batch.chance = grow.chance
        if self.options.tree != "static" and ctx.cfg.greedy:
            ctx.budget.trees.batch.paid(grow.pays)
        self.kv.keep(base, torch.zeros(len(ctx.tokens), 0, dtype=torch.long, device=self.target.device),
                     torch.zeros(len(ctx.tokens), dtype=torch.long, device=self.target.device))
        self.kv.compact()
        return tree


def _level_cost(head, target) -> float:
    """One head forward relative to one target forward, by the weights each reads (decoding is memory-bound):
    the head's own weights, plus the target's it reads (the LM head's rows it drafts over: `borrowed_weights`)."""
    own = sum(p.numel() for p in head.parameters())
    return (own + head.borrowed_weights(target)) / sum(p.numel() for p in target.model.parameters())


def _cat_rows(feats: torch.Tensor, tokens: list[list[int]], more: torch.Tensor, gained: list[list[int]]):
    """Per row, the first len(tokens[b]) entries of feats [B, L, F] followed by the first len(gained[b]) of more
    [B, M, F], left-aligned and zero-padded: [B, L', F]."""
    rows = [torch.cat([feats[b, : len(t)], more[b, : len(g)]]) for b, (t, g) in enumerate(zip(tokens, gained))]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
