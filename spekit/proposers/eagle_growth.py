"""One EAGLE step's draft tree as it grows (`Growth`): the head fed level by level over the frontier, and the tree's
shape chosen per step: EAGLE-2's dynamic tree under greedy decoding, one sampled chain per row under sampling, or
a static tree of child ranks (`static_plan`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..heads.eagle import additive
from ..sampling import target_probs
from ..tree import DraftTree, build
from .base import StepContext

if TYPE_CHECKING:
    from .eagle import Eagle


class Growth:
    """One step's draft tree as it grows: nodes (0 = root) with tokens, parents, cumulative log-probabilities and,
    under sampling, q; the nodes fed to the head so far (their KV slots follow `base` in the head's cache)."""

    def __init__(self, owner: Eagle, ctx: StepContext, root_out: torch.Tensor, base: int):
        self.owner, self.head, self.ctx, self.base = owner, owner.head, ctx, base
        batch, device = root_out.shape[0], root_out.device
        self.rows = torch.arange(batch, device=device)
        self.tokens = ctx.pending[:, None].clone()                           # [B, n]
        self.parents = torch.full((batch, 1), -1, dtype=torch.long, device=device)
        self.depth = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.score = torch.zeros(batch, 1, device=device)
        self.valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
        self.q = None if ctx.cfg.greedy else [torch.zeros(batch, 1, owner.target.vocab_size, device=device)]
        self.out = root_out[:, None]                                           # [B, 1 + fed, H]; 0 = root
        self.slot = torch.zeros(batch, 1, dtype=torch.long, device=device)  # node -> index into out (0 = none)
        self.fed_anc = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)   # [B, f, f] fed ancestry
        self.chance = None
        self.pays = True

    def add(self, parents, tokens, logp, q=None, valid=None) -> torch.Tensor:
        """Append children: parents, tokens, logp [B, m]; q [B, m, V]. Returns their node ids [B, m]."""
        start = self.tokens.shape[1]
        pscore = self.score.gather(1, parents)
        pvalid = self.valid.gather(1, parents)
        self.tokens = torch.cat([self.tokens, tokens], 1)
        self.parents = torch.cat([self.parents, parents], 1)
        self.depth = torch.cat([self.depth, self.depth.gather(1, parents) + 1], 1)
        self.score = torch.cat([self.score, pscore + logp], 1)
        self.valid = torch.cat([self.valid, pvalid & (True if valid is None else valid)], 1)
        self.slot = torch.cat([self.slot, torch.zeros_like(parents)], 1)
        if q is not None:
            self.q.append(q)
        ids = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return ids[None].expand(tokens.shape[0], -1)

    def feed(self, nodes: torch.Tensor) -> torch.Tensor:
        """One head forward over nodes [B, w] (all non-root), each reading its parent's output. Returns the
        draft logits [B, w, Vd]."""
        owner, kv = self.owner, self.owner.kv
        batch, w = nodes.shape
        f = self.fed_anc.shape[1]
        pslot = self.slot.gather(1, self.parents.gather(1, nodes))                   # [B, w] 0 = root
        inp = self.out[self.rows[:, None], pslot]                                    # [B, w, H]
        onehot = torch.nn.functional.one_hot((pslot - 1).clamp(min=0), max(f, 1))[..., :f].bool() \
            & (pslot > 0)[..., None]
        prow = self.fed_anc[self.rows[:, None], (pslot - 1).clamp(min=0)] if f else onehot
        anc = (prow & (pslot > 0)[..., None]) | onehot                               # [B, w, f]
        pos = self.ctx.positions[:, None] - 1 + self.depth.gather(1, nodes)
        committed = (kv.slot_pos[:, : self.base] >= 0)[:, None].expand(-1, w, -1)
        eye = torch.eye(w, dtype=torch.bool, device=nodes.device)[None].expand(batch, -1, -1)
        mask = additive(torch.cat([committed, anc, eye], 2), owner.target.dtype)
        tok = self.tokens.gather(1, nodes)
        out = self.head.step(owner.embed(tok), inp, pos, mask, kv.cache)
        kv.appended(pos)
        grown = torch.zeros(batch, f + w, f + w, dtype=torch.bool, device=nodes.device)
        grown[:, :f, :f] = self.fed_anc
        grown[:, f:, :f] = anc
        self.fed_anc = grown
        self.slot.scatter_(1, nodes, torch.arange(f + 1, f + w + 1, device=nodes.device)[None].expand(batch, -1))
        self.out = torch.cat([self.out, out], 1)
        return self.head.draft_logits(out, owner.target)

    def children(self, logits: torch.Tensor, count: int, drawing: list[bool] | None = None,
                 q: torch.Tensor | None = None):
        """count children of each of w nodes from their draft logits [B, w, Vd]: target ids [B, w, c], log q
        [B, w, c], under sampling q [B, w, c, V], and validity [B, w, c] (False past the vocabulary's end, and
        under sampling past the support of q: siblings are drawn without replacement). Under sampling, drawing
        (host, [B]): the rows that draw (the others take no random numbers; their children are q's most likely
        tokens, for the caller to mark invalid); q [B, w, V]: the processed distribution, if already computed."""
        have = min(count, logits.shape[-1])
        tok, lp, q, valid = self._draw(logits, have, drawing, q)
        if have < count:
            extra = count - have
            tok = torch.cat([tok, tok[..., -1:].expand(*tok.shape[:2], extra)], -1)
            lp = torch.cat([lp, lp.new_full((*lp.shape[:2], extra), float("-inf"))], -1)
            valid = torch.cat([valid, valid.new_zeros(*valid.shape[:2], extra)], -1)
            if q is not None:
                q = torch.cat([q, q[:, :, -1:].expand(-1, -1, extra, -1)], 2)
        return tok, lp, q, valid

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [B, w, Vd] -> the head's processed distribution over target ids [B, w, V] (sampling)."""
        ids, vocab = self.head.draft_ids, self.owner.target.vocab_size
        full = logits.float() if ids is None else logits.new_full((*logits.shape[:2], vocab), float("-inf")) \
            .float().index_copy_(-1, ids, logits.float())
        return target_probs(full, self.ctx.cfg, None)

    def _draw(self, logits: torch.Tensor, count: int, drawing: list[bool] | None = None,
              q: torch.Tensor | None = None):
        ids = self.head.draft_ids
        if self.q is None:
            lp, idx = logits.float().log_softmax(-1).topk(count, dim=-1)
            return (idx if ids is None else ids[idx]), lp, None, torch.ones_like(idx, dtype=torch.bool)
        q = self._q(logits) if q is None else q                                    # [B, w, V]
        still = torch.zeros(q.shape[1:], device=q.device)
        gumbel = torch.stack([-(-torch.rand(q.shape[1:], generator=g, device=g.device).log()).log()
                              if drawing is None or drawing[b] else still
                              for b, g in enumerate(self.ctx.gens)]).to(q.device)
        tok = (q.log() + gumbel).topk(count, dim=-1).indices                       # [B, w, c] draw order
        qs, valid, cur = [], [], q
        for j in range(count):
            valid.append(cur.sum(-1) > 0)
            qs.append(cur)
            cur = cur.scatter(-1, tok[..., j:j + 1], 0.0)
            cur = cur / cur.sum(-1, keepdim=True).clamp(min=1e-30)
        lp = q.gather(-1, tok).clamp(min=1e-30).log()
        return tok, lp, torch.stack(qs, 2), torch.stack(valid, 2)

    def finish(self, keep: torch.Tensor | None = None) -> DraftTree:
        """The DraftTree of the kept nodes keep [B, m] (ids in increasing order, root excluded), or of all."""
        if keep is None:
            keep = torch.arange(1, self.tokens.shape[1], device=self.tokens.device)[None].expand(len(self.rows), -1)
        nodes = torch.cat([keep.new_zeros(keep.shape[0], 1), keep], 1)             # [B, N]
        new_id = torch.full_like(self.tokens, -1)
        new_id.scatter_(1, nodes, torch.arange(nodes.shape[1], device=nodes.device)[None].expand_as(nodes))
        parents = new_id.gather(1, self.parents.gather(1, nodes).clamp(min=0))
        parents[:, 0] = -1
        q = None if self.q is None else torch.cat(self.q, 1)[self.rows[:, None], nodes]
        return build(self.tokens.gather(1, nodes), parents, self.valid.gather(1, nodes), q)

    # --- the three shapes -------------------------------------------------------------------------------------

    def dynamic_greedy(self, root_logits: torch.Tensor) -> DraftTree:
        """Grown level by level while a level raises the expected tokens per unit of cost: the host decides, by
        design (it weighs the measured cost of each tree size), from one read of the tree's figures per level."""
        k, depth = self.owner.options.branching, self.owner.options.depth
        batch = len(self.rows)
        tok, lp, _, valid = self.children(root_logits[:, None], k)
        level = self.add(torch.zeros_like(tok[:, 0]), tok[:, 0], lp[:, 0], valid=valid[:, 0])
        rate = 0.0
        for levels in range(1, depth):
            sums, newest, order = self._read(level)
            if levels > 1 and self.ctx.budget.trees.batch.cal * newest < self.owner.options.min_prob:
                break                  # no path of the newest level is min_prob likely: stop drafting deeper
            now = self._size(sums, levels)[1]
            if now <= rate:            # the last level did not raise tokens per unit of cost: stop growing
                break
            rate = now
            top = self.score.gather(1, level).topk(min(k, level.shape[1]), dim=1).indices
            frontier = level.gather(1, top)                                          # [B, w]
            tok, lp, _, valid = self.children(self.feed(frontier), k)                # [B, w, k]
            parents = frontier[..., None].expand_as(tok).reshape(batch, -1)
            level = self.add(parents, tok.reshape(batch, -1), lp.reshape(batch, -1),
                             valid=valid.reshape(batch, -1))
        else:
            sums, _, order = self._read(level)
            levels = depth
        n, rate = self._size(sums, levels - 1)
        self.owner.fed = levels - 1
        self.pays = rate > len(self.ctx.budget.counted()) * self.ctx.budget.margin
        return self.finish((order[:, :n] + 1).sort(dim=1).values)

    def _read(self, level: torch.Tensor) -> tuple[list[float], float, torch.Tensor]:
        """The tree's figures in one read from the device: the best paths' probabilities (at most total_tokens)
        summed over the batch's counted rows (Budget.counted) and accumulated, [0, p1, p1 + p2, ...]; the best
        path probability in `level` [B, m]
        (the newest level's node ids); and the nodes best first, parents before children on ties ([B, n] ids - 1,
        left on the device)."""
        rank = self.score[:, 1:] - 1e-6 * self.depth[:, 1:]
        order = rank.sort(dim=1, descending=True)
        best = order.values.exp()[:, : self.owner.options.total_tokens]                  # [B, n]
        sums = best[self.ctx.budget.counted()].sum(0).cumsum(0)
        host = torch.cat([sums, self.score.gather(1, level).max().exp()[None]]).tolist()
        return [0.0] + host[:-1], host[-1], order.indices

    def _size(self, sums: list[float], fed: int) -> tuple[int, float]:
        """How many of the best nodes to verify, and the tokens per unit of cost that gives: the target's
        verification plus the head's forwards (the catch-up and `fed` draft levels, each `level_cost`).
        sums: the best paths' summed probabilities from `_read` (a sum is the expected accepted length)."""
        batch = len(self.ctx.budget.counted())
        cal = self.ctx.budget.trees.batch.cal
        drafting = (1 + fed) * self.owner.level_cost + self.ctx.budget.trees.overhead.value
        rates = [(batch + cal * sums[n]) / (self.ctx.budget.cost(n + 1) + drafting) for n in range(1, len(sums))]
        best = max(range(len(rates)), key=rates.__getitem__) + 1
        self.chance = sums[best]
        return best, rates[best - 1]

    def sampled_chains(self, root_logits: torch.Tensor, allowed: list[bool]) -> DraftTree:
        """Under sampling: one sampled chain per row, each row one level deeper while that raises its expected
        tokens per unit of cost, against the PRIOR cost table (ctx.budget.cost under sampling). Every decision is per
        row and off the clock, and a row draws random numbers only for the levels it keeps, so a row's sample
        depends on its seed and its own text only, not on its batch. Exact only if no level's keeping depends on
        its own draw: a level is decided before it is drawn, from the chance that a draw from its q matches the
        head's own draw (sum of q^2) times the levels above. (Deciding from the drawn token's q kept likely draws
        and dropped unlikely ones: the verified drafts then no longer followed q.) allowed [B] (host): the rows
        not resting. A row whose chain does not pay by the budget's margin rests, as under greedy decoding (fixed
        chains would draft at a loss where the head is rarely accepted at that temperature). One read from the device per level."""
        owner = self.owner
        paces = self.ctx.budget.trees.rows
        cal = torch.tensor([row.cal for row in paces], device=root_logits.device)          # [B]
        keep = torch.tensor(allowed, device=root_logits.device)                             # [B] bool
        reach = torch.ones(len(self.rows), device=root_logits.device)       # [B] chance the chain so far is accepted
        chance = torch.zeros_like(reach)                                     # [B] expected accepted draft tokens
        rate = torch.ones_like(reach)                                        # [B] tokens per unit of cost so far
        logits, level, depth = root_logits[:, None], None, torch.zeros_like(keep, dtype=torch.long)
        for d in range(1, owner.options.depth + 1):
            if d > 1:
                logits = self.feed(level)
            q = self._q(logits)                                                              # [B, 1, V]
            reach = reach * _matches(q[:, 0])
            now = self._row_rate(cal, chance + reach, d)
            keep = keep & (now > rate)
            drawing = keep.tolist()
            if not any(drawing):
                break
            tok, lp, qs, valid = self.children(logits, 1, drawing, q)                       # [B, 1, 1]
            parents = torch.zeros_like(tok[..., 0]) if level is None else level
            level = self.add(parents, tok[..., 0], lp[..., 0], qs[:, :, 0], valid[..., 0] & keep[:, None])
            depth = torch.where(keep, d, depth)
            chance = torch.where(keep, chance + reach, chance)
            rate = torch.where(keep, now, rate)
        for b, (pays, got) in enumerate(zip((rate > self.ctx.budget.margin).tolist(), (chance * (depth > 0)).tolist())):
            if allowed[b]:
                paces[b].drafted(pays, got)
        deepest = int(depth.max())
        self.chance = float(chance.sum()) if deepest else None
        levels = torch.arange(1, deepest + 1, device=depth.device)
        return self.finish(levels[None].expand(len(self.rows), -1))

    def _row_rate(self, cal: torch.Tensor, chance: torch.Tensor, depth: int) -> torch.Tensor:
        """Each row's expected tokens per unit of cost [B] when it verifies `depth` levels of its chain, expected
        to gain chance [B] draft tokens, calibrated by cal [B] (learnt from the row's earlier acceptances)."""
        prices = [self.ctx.budget.row_cost(b)(depth + 1) for b in range(len(self.rows))]
        cost = torch.tensor(prices, device=chance.device)
        return (1 + cal * chance) / (cost + depth * self.owner.level_cost)

    def static(self, root_logits: torch.Tensor, plan) -> DraftTree:
        """The fixed tree: level by level, every node with children in the tree draws as many as it needs (`plan`,
        from `static_plan`: the node ids are known beforehand, nothing is read back from the device)."""
        levels, kept = plan
        batch = len(self.rows)
        logits = {(): root_logits[:, None]}
        for parents, fed, groups in levels:
            if fed is not None:
                out = self.feed(fed[None].expand(batch, -1))
                logits = {p: out[:, i:i + 1] for i, p in enumerate(parents)}
            for p, node, count, pick in groups:
                tok, lp, q, valid = self.children(logits[p], count)
                self.add(torch.full((batch, len(pick)), node, device=tok.device), tok[:, 0, pick], lp[:, 0, pick],
                         None if q is None else q[:, 0, pick], valid[:, 0, pick])
        return self.finish(kept[None].expand(batch, -1))


def static_plan(paths, device: torch.device):
    """How the static tree of `paths` (child ranks, parents first) grows, worked out once: per level, its parents'
    paths, their node ids to feed ([P] on device; None at the root's level) and per parent (path, node id, children
    to draw, the ranks kept [c] on device); then the ids of the tree's nodes in increasing order ([N] on device).
    Nodes are numbered as they are added (level by level, parents in sorted order)."""
    index, levels = {(): 0}, []
    for level in range(1, len(paths[-1]) + 1):
        parents = sorted({tuple(p[:-1]) for p in paths if len(p) == level})
        fed = torch.tensor([index[p] for p in parents], device=device) if level > 1 else None
        groups = []
        for p in parents:
            ranks = [c[-1] for c in paths if len(c) == level and tuple(c[:-1]) == p]
            groups.append((p, index[p], max(ranks) + 1, torch.tensor(ranks, device=device)))
            for r in ranks:
                index[p + (r,)] = len(index)
        levels.append((parents, fed, groups))
    return levels, torch.tensor(sorted(index[tuple(p)] for p in paths), device=device)


def _matches(q: torch.Tensor) -> torch.Tensor:
    """q [B, V] -> [B]: the chance that two independent draws from q agree (sum of q^2), the head's estimate of
    how often its draw from q is accepted, known before the draw."""
    return (q.float() ** 2).sum(-1)
