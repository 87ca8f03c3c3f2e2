"""Medusa (Cai et al. 2024): K heads over the target's last hidden state guess the tokens 2..K+1 ahead; their
top-k candidates fill a STATIC tree (paths of choices: [[0], [1], [0, 0], ...], path [c0, c1] = head 0's choice
c0 then head 1's choice c1) that the target verifies in one forward. Lossless by default: the acceptance module's
rule, with the drafted tokens as point masses (q=None). `--acceptance typical` opts into Medusa's typical
acceptance, which is LOSSY and labelled so.

The tree is built once from the heads' measured top-k accuracies (greedy: repeatedly add the path whose product
of accuracies is largest) and stored with the heads. Each step uses the prefix of it that pays best: expected
tokens (1 + the sum of the nodes' path products, with accuracies re-estimated online per row from what the target
commits) per unit of the cost: the measured verification (ctx.budget.cost) plus the heads that run (each a residual
block and the LM head over the draft vocabulary, by the weights it reads); a prefix of 0 nodes is a plain step.
Under greedy decoding a step where no prefix pays makes the heads rest (plain steps, heads idle) for 4 to 64
steps, doubling while drafting keeps not paying, and a new greedy generation starts from the accuracies the last
one learnt: the heads run only when a step drafts, so a held generation pays nothing for keeping its estimates.
Sampling keeps every decision per row and off the batch (a row's sample must not depend on its batch mates).
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from pathlib import Path

import torch

from ..acceptance import TypicalAcceptance
from ..config import UserError
from ..heads import load_head
from ..heads.base import shipped_dir
from ..heads.medusa import target_lm_weight
from ..tree import DraftTree, build, from_paths, roots, with_forced
from .base import Proposer, StepContext, register

SIZES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
PRIOR_WEIGHT = 8.0     # the stored accuracies count as this many observations
DECAY = 0.97           # per observation: the online estimates follow the text
MAX_NODES = 256        # most nodes `spekit medusa tree` builds (each is a token verified per step)


@dataclass(frozen=True)
class MedusaOptions:
    heads: str = ""                   # head directory (default: the shipped heads for the model, when present)
    tree_size: int = 0                # most draft nodes per step (0: the whole tree stored with the heads)
    acceptance: str = "lossless"      # or "typical": Medusa's typical acceptance, LOSSY (sampling only)
    typical_epsilon: float = 0.09     # typical acceptance (lossy): hard threshold
    typical_delta: float = 0.3        # typical acceptance (lossy): entropy-scaled threshold factor

    def __post_init__(self) -> None:
        if self.tree_size < 0:
            raise UserError(f"tree_size must be >= 0, got {self.tree_size}")
        if self.acceptance not in ("lossless", "typical"):
            raise UserError(f"acceptance must be 'lossless' or 'typical' (lossy), got {self.acceptance!r}")
        TypicalAcceptance(self.typical_epsilon, self.typical_delta)
        typed = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                 if f.name.startswith("typical_") and getattr(self, f.name) != f.default]
        if typed and self.acceptance != "typical":
            raise UserError(f"{' and '.join(typed)} set the typical acceptance; they need --acceptance typical "
                            f"(LOSSY), the default acceptance is lossless")


def best_paths(accuracy: list[list[float]], budget: int) -> list[list[int]]:
    """The static tree of `budget` nodes with the largest expected acceptance: accuracy[d][c] is the measured
    probability that head d's c-th candidate is the target's token; a node's value is the product along its path.
    Greedy (values only shrink going down, so parents always come first). Returns paths in the order added."""
    depth = len(accuracy)
    heap = [(-accuracy[0][c], (c,)) for c in range(len(accuracy[0]))]
    heapq.heapify(heap)
    out: list[list[int]] = []
    while heap and len(out) < budget:
        neg, path = heapq.heappop(heap)
        out.append(list(path))
        if len(path) < depth:
            for c, a in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (neg * a, path + (c,)))
    return out


def default_accuracy(num_heads: int, topk: int = 10) -> list[list[float]]:
    """A prior for heads whose accuracies were never measured."""
    return [[0.4 * 0.6 ** d / (c + 1) for c in range(topk)] for d in range(num_heads)]


def stored_accuracy(meta: dict, heads: int, directory) -> list[list[float]]:
    """The accuracies stored with the heads (meta "accuracy"), else the prior; UserError naming the folder's
    config.json when they are not `heads` rows of numbers in [0, 1]."""
    accuracy = meta.get("accuracy") or default_accuracy(heads)
    if not (isinstance(accuracy, list) and len(accuracy) == heads
            and all(isinstance(row, list) and row and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in row)
                    for row in accuracy)):
        raise UserError(f"{Path(directory) / 'config.json'}: meta.accuracy must be {heads} lists (one a head) of "
                        f"accuracies in [0, 1]")
    return accuracy


def heads_dir(options: MedusaOptions, target) -> Path:
    """--heads, else the shipped heads made for a model of this target's shape."""
    if options.heads:
        return Path(options.heads)
    found = shipped_dir("medusa", target)
    if found is not None:
        return found
    raise UserError("no Medusa heads for this model: pass --heads DIR (train them with `spekit train medusa`)")


@register
class Medusa(Proposer):
    name = "medusa"
    Options = MedusaOptions
    needs_hidden_states = True
    help = ("Medusa heads over the last hidden state, static tree (--heads DIR; --acceptance typical is LOSSY)")
    paced_trees = True             # greedy rests after a step where no prefix paid: ctx.budget.trees

    def __init__(self, target, options: MedusaOptions, draft=None):
        super().__init__(target, options, draft)
        directory = heads_dir(options, target)
        self.head = load_head(directory, target, kind="medusa").to(target.dtype)
        meta = getattr(self.head, "meta", {}) or {}
        k = self.head.config.num_heads
        accuracy = [row[: self.head.out_size] for row in stored_accuracy(meta, k, directory)]
        paths = meta.get("tree") or best_paths(accuracy, 64)
        if options.tree_size:
            paths = paths[: options.tree_size]
        _check_tree(paths, k, len(accuracy[0]), target.max_positions)
        self.paths = paths
        self.prior = torch.tensor(accuracy, dtype=torch.float64)                          # [K, C]
        choice = torch.full((len(paths), k), -1, dtype=torch.long)
        for i, p in enumerate(paths):
            choice[i, : len(p)] = torch.tensor(p)
        self.choice = choice                                                               # [P, K], -1 past the end
        self.topk = int(choice.max()) + 1 if paths else 1
        if options.acceptance == "typical":
            self.lossy_rule = TypicalAcceptance(options.typical_epsilon, options.typical_delta)
            self.lossless = False
        self.weight = self.head.output_weight(target_lm_weight(target)).detach().contiguous()   # [Vd, H]
        self._trees: dict[tuple[int, int], DraftTree] = {}
        self.reach = [max((len(q) for q in paths[:s]), default=1) for s in range(len(paths) + 1)]  # heads needed
        self.head_cost = self._head_cost(target)
        self.learned = self.prior                  # greedy: the accuracies a new generation starts from

    def _head_cost(self, target) -> float:
        """One head's forward relative to a one-token target forward, by the weights each reads."""
        block = sum(p.numel() for p in self.head.blocks.parameters()) / max(1, self.head.config.num_heads)
        return (block + self.weight.numel()) / sum(p.numel() for p in target.model.parameters())

    # --- state ------------------------------------------------------------------------------------------------

    def hidden_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)                                # the last one, after the final norm

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self.h = hidden[-1][:, -1]                                                 # [B, H] at the last prompt token
        batch = len(ctx.tokens)
        if ctx.cfg.greedy and hasattr(self, "hits"):      # what the last greedy generation learnt, rows averaged
            self.learned = (self.hits / self.seen[..., None]).clamp(max=1.0).mean(0)
        start = self.learned if ctx.cfg.greedy else self.prior
        self.hits = start[None].repeat(batch, 1, 1) * PRIOR_WEIGHT                   # [B, K, C] decayed counts
        self.seen = torch.full((batch, self.prior.shape[0]), PRIOR_WEIGHT, dtype=torch.float64)   # [B, K]
        self.guesses: list[list[tuple[int, list[list[int]], int]]] = [[] for _ in range(batch)]

    def select_rows(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, device=self.h.device)
        self.h = self.h[idx]
        self.hits, self.seen = self.hits[rows], self.seen[rows]
        self.guesses = [self.guesses[r] for r in rows]

    # --- drafting ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, ctx: StepContext) -> DraftTree:
        """The heads' tree, with the text a grammar forces grafted on (structured output; observe reads the
        deepest accepted node, wherever it is)."""
        return with_forced(self._heads_tree(ctx), ctx.forced)

    def _heads_tree(self, ctx: StepContext) -> DraftTree:
        if ctx.cfg.greedy and not ctx.budget.trees.batch.ready():   # drafting did not pay lately: a plain step, the heads idle
            return self._plain(ctx)
        sizes = self._sizes(ctx)
        n = max(sizes)
        if ctx.cfg.greedy:
            ctx.budget.trees.batch.paid(n > 0)
        reach = [max((len(p) for p in self.paths[:s]), default=1) for s in sizes]      # deepest node per row
        logits = self.head(self.h.to(self.weight.dtype), self.weight, max(reach))     # [K', B, Vd]
        cand = self.head.to_tokens(logits.topk(self.topk, dim=-1).indices)             # [K', B, C] token ids
        host = cand.permute(1, 0, 2).tolist()                                           # [B][K'][C]
        for b, tokens in enumerate(ctx.tokens):     # a row learns from its own heads only: batch-independent
            self.guesses[b].append((len(tokens), host[b][: reach[b]], 0))
        depth = self.choice[:n].clamp(min=0)
        last = (self.choice[:n] >= 0).sum(1) - 1                                        # [n] depth index of node
        tokens = cand[last, :, depth[torch.arange(n), last]].t()                       # [B, n]
        tree = self._tree(n, len(sizes))
        tokens = torch.cat([ctx.pending[:, None], tokens.to(ctx.pending.device)], dim=1)  # [B, n+1]
        if all(s == n for s in sizes):
            return dataclasses.replace(tree, tokens=tokens)
        valid = torch.arange(n + 1, device=tokens.device)[None] <= torch.tensor(sizes, device=tokens.device)[:, None]
        return build(tokens, tree.parents, valid, None)

    def _plain(self, ctx: StepContext) -> DraftTree:
        return roots(ctx.pending)

    def _tree(self, n: int, batch: int) -> DraftTree:
        """The compiled tree of the first n paths (tokens are filled in per step)."""
        key = (n, batch)
        if key not in self._trees:
            root = torch.zeros(batch, dtype=torch.long, device=self.h.device)
            self._trees[key] = from_paths(root, self.paths[:n], torch.zeros(batch, n, dtype=torch.long,
                                                                             device=self.h.device))
        return self._trees[key]

    def _sizes(self, ctx: StepContext) -> list[int]:
        """Tree prefix per row: the one that gives most expected tokens per unit of cost (greedy: one for the
        batch, against the measured cost; sampling: per row, against the prior, so rows stay independent)."""
        est = (self.hits / self.seen[..., None]).clamp(max=1.0)                       # [B, K, C]
        p, k = self.choice.shape
        picked = est[:, torch.arange(k)[None, :].expand(p, k), self.choice.clamp(min=0)]   # [B, P, K]
        value = torch.where(self.choice[None] >= 0, picked, torch.ones_like(picked)).prod(-1)   # [B, P]
        gain = torch.cat([torch.zeros(value.shape[0], 1, dtype=value.dtype), value.cumsum(1)], 1) + 1  # [B, P+1]
        room = [min(r, p) for r in ctx.room]
        options = [s for s in SIZES if s <= p] + ([p] if p not in SIZES else [])
        if ctx.cfg.greedy:
            counted = ctx.budget.counted()                   # the rows whose progress ends the batch sooner
            totals = gain[counted].sum(0).tolist()
            best = self._best(options, lambda s: totals[s], ctx.budget.cost, len(counted), ctx.budget.margin)
            return [self._limit(best, r) for r in room]
        rows = gain.tolist()
        return [self._limit(self._best(options, lambda s: rows[b][s], ctx.budget.row_cost(b), 1, ctx.budget.margin), r)
                for b, r in enumerate(room)]

    def _best(self, options: list[int], gain, cost, rows: int, margin: float) -> int:
        best, best_rate = 0, float(rows)
        for s in options:
            rate = gain(s) / (cost(s + 1) + self.reach[s] * self.head_cost)
            if s and rate > best_rate * margin:
                best, best_rate = s, rate
        return best

    def _limit(self, size: int, room: int) -> int:
        """The longest prefix of at most `size` paths whose nodes all fit in the room left in the context."""
        for i, path in enumerate(self.paths[:size]):
            if len(path) > room:
                return i
        return size

    # --- learning from the verdict ------------------------------------------------------------------------------

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None) -> None:
        rows = torch.arange(len(gained), device=verdict.path.device)
        node = verdict.path[rows, verdict.accepted]                                    # [B] deepest accepted
        self.h = hidden[-1][rows.to(hidden[-1].device), node.to(hidden[-1].device)]
        for b, new in enumerate(gained):
            self._score(b, ctx.tokens[b] + new)

    def _score(self, b: int, text: list[int]) -> None:
        """Check the row's earlier guesses against the committed text: head d's guess made when the context had
        n tokens is for text[n + d]. Head d is counted while heads 0..d-1 of that guess had the true tokens among
        their candidates (the condition under which the tree can reach depth d)."""
        keep = []
        for n, cand, d in self.guesses[b]:
            while d < len(cand) and n + d < len(text):
                self.hits[b, d] *= DECAY
                self.seen[b, d] = self.seen[b, d] * DECAY + 1
                tok = text[n + d]
                if tok not in cand[d]:
                    d = len(cand)
                    break
                self.hits[b, d, cand[d].index(tok)] += 1
                d += 1
            if d < len(cand):
                keep.append((n, cand, d))
        self.guesses[b] = keep


def _check_tree(paths: list[list[int]], heads: int, topk: int, max_positions: int) -> None:
    if len(paths) + 1 >= max_positions:
        raise UserError(f"the Medusa tree has {len(paths)} nodes; the model's context is {max_positions} tokens")
    if not isinstance(paths, list) or not all(isinstance(p, list) and all(isinstance(c, int) for c in p)
                                              for p in paths):
        raise UserError("the Medusa tree stored with the heads (meta.tree) is not a list of paths of choices")
    for p in paths:
        if not p or len(p) > heads or min(p) < 0 or max(p) >= max(topk, 1):
            raise UserError(f"tree path {p} does not fit {heads} heads with {topk} candidates each")
    try:
        from_paths(torch.zeros(1, dtype=torch.long), paths, torch.zeros(1, len(paths), dtype=torch.long))
    except ValueError as err:
        raise UserError(f"bad Medusa tree: {err}") from None


