"""The only decider: which draft tokens are accepted, and which token follows them.

One rule for chains and trees, soft and point-mass drafts (Leviathan et al. 2023; the multi-candidate form of
SpecInfer): walking down from the root, each child x of the current node, in sibling order, is accepted with
probability min(1, p(x) / q(x)), where p is the target's processed distribution at the current node (after the
earlier siblings were rejected) and q the distribution x was drawn from (one-hot for a point-mass draft). A
rejected sibling turns p into the residual norm(max(p - q, 0)). When no child is accepted (or the node is a leaf)
the next token is sampled from p: a *recovered* token after a rejection, a *bonus* token after a full path.
Every output token is distributed exactly as plain sampling from the target would give it.

A row whose draft is a chain of drawn tokens (one child per node, q below 1 at a node's own token) is judged by
block verification instead (Sun et al. 2024, `_block`): the chain jointly, which keeps the same law and never
fewer drafts on average (`SamplingConfig.verification = "token"` keeps the walk above for them). For point-mass
drafts the two agree, so they keep the walk.

Greedy (temperature 0) is the same rule with p one-hot on the argmax; `_greedy` is its vectorised fast path,
and a test shows the two agree. `plain_greedy` is that rule for a plain step (every row's root alone) whose
settings leave the logits as they are, on logits the target holds in host memory: the first argmax of each row,
without tensors (on a CPU backend the step's host work is a measurable part of it; see engine `_plain_step`).

Two LOSSY rules exist beside it, each only as an explicit opt-in: Medusa's typical acceptance, which a proposer
declares (`Proposer.lossy_rule`; `TypicalAcceptance`, `typical_lossy`), and the relaxed rule of any method
(`SamplingConfig.relaxed` > 0, `relaxed_lossy`). Their output does NOT follow the target's distribution (nor, greedy,
plain's text); everything that reports on them says "lossy".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .config import SamplingConfig, UserError
from .sampling import Seen, greedy_tokens, penalize, row_sample, target_probs, warp
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: torch.Tensor        # [B, D+1] long: accepted node ids from the root (path[:, 0] == 0), -1 padded
    accepted: torch.Tensor    # [B] long: accepted draft tokens (path length - 1)
    next_token: torch.Tensor  # [B] long: the recovered or bonus token that follows the accepted path


class PlainVerdict:
    """The Verdict of a plain step decided by `plain_greedy`: every row's root alone, nothing accepted, the next
    tokens as host ints. Its tensors are made when a proposer reads them (the drafters a CPU backend runs do not)."""

    def __init__(self, next_tokens: list[int], device: torch.device):
        self.tokens, self.device = next_tokens, device

    @cached_property
    def next_token(self) -> torch.Tensor:                                      # [B] long
        return torch.tensor(self.tokens, dtype=torch.long, device=self.device)

    @cached_property
    def accepted(self) -> torch.Tensor:                                        # [B] long
        return torch.zeros(len(self.tokens), dtype=torch.long, device=self.device)

    @cached_property
    def path(self) -> torch.Tensor:                                            # [B, 1] long
        return self.accepted[:, None]


def plain_greedy(logits: np.ndarray) -> list[int]:
    """The greedy rule for a plain step: logits [B, V] float32 in host memory, the target's own (no logit bias, no
    penalty applies: `sampling.untouched`). Each row's first maximum, as `verify` picks it."""
    return np.argmax(logits, axis=-1).tolist()


@dataclass(frozen=True)
class TypicalAcceptance:
    """LOSSY, opt-in: Medusa's typical acceptance (Cai et al. 2024). Under sampling a draft token x at a node is
    accepted when p(x) > min(epsilon, delta * exp(-H(p))), H the entropy of the target's processed distribution p
    there; the deepest path of accepted tokens wins and the next token is sampled from p after it. Faster, but the
    output no longer follows the target's distribution. Under greedy decoding it is the lossless greedy rule."""

    epsilon: float = 0.09     # hard probability threshold
    delta: float = 0.3        # entropy-scaled threshold factor

    def __post_init__(self) -> None:
        if not 0 < self.epsilon < 1 or not 0 < self.delta:
            raise UserError(f"typical acceptance needs 0 < epsilon < 1 and delta > 0, got {self.epsilon}, "
                            f"{self.delta}")


def verify(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, seen: Seen | None,
           gens: list[torch.Generator] | None, fast_greedy: bool = True,
           lossy: TypicalAcceptance | None = None) -> Verdict:
    """Decide one step. logits: [B, N, V] target logits at every tree node; seen: what the penalties need of the
    committed context (root included), [B, V] each, or None (sampling.seen_of); gens: one generator per row.
    lossy: an opt-in lossy rule (sampling only), None for the exact rule."""
    assert logits.shape[:2] == tree.tokens.shape, (logits.shape, tree.tokens.shape)
    node_seen = _node_seen(tree, seen, logits.shape[-1]) if seen is not None else None
    if cfg.relaxed > 0:
        return relaxed_lossy(tree, logits, cfg, node_seen, gens)
    if cfg.greedy and fast_greedy:
        return _greedy(tree, greedy_tokens(logits, cfg, node_seen))
    assert gens is not None and len(gens) == tree.tokens.shape[0], "one generator per row"
    if lossy is not None and not cfg.greedy:
        return typical_lossy(tree, target_probs(logits, cfg, node_seen), lossy, gens)
    p = target_probs(logits, cfg, node_seen)
    if cfg.verification != "block" or tree.q is None:
        return _rejection(tree, p, gens)
    chains = _soft_chains(tree)
    if not bool(chains.any()):
        return _rejection(tree, p, gens)
    if bool(chains.all()):
        return _block(tree, p, gens)
    # a row's rule is its own tree's, whatever the rest of the batch drafted: each part apart
    parts = ((chains.nonzero()[:, 0], _block), ((~chains).nonzero()[:, 0], _rejection))
    return _merge([(rows, rule(_take(tree, rows), p[rows], [gens[i] for i in rows.tolist()]))
                   for rows, rule in parts], tree)


def typical_lossy(tree: DraftTree, p: torch.Tensor, rule: TypicalAcceptance, gens: list[torch.Generator]) -> Verdict:
    """LOSSY typical acceptance (see TypicalAcceptance). p: [B, N, V] processed target distributions."""
    batch = p.shape[0]
    rows = torch.arange(batch, device=p.device)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)                          # [B, N]
    threshold = torch.clamp(rule.delta * torch.exp(-entropy), max=rule.epsilon)  # [B, N]
    parent = tree.parents.clamp(min=0)                                         # [B, N]
    p_token = p[rows[:, None], parent, tree.tokens]                            # [B, N] p(x) at the parent
    ok = tree.valid & (p_token > threshold.gather(1, parent))
    best = _deepest(tree, ok)                                                  # [B]
    nxt = _sample_rows(p[rows, best], gens, torch.ones(batch, dtype=torch.bool, device=p.device))
    return Verdict(_path_to(tree, best), tree.depth[rows, best], nxt)


def relaxed_lossy(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, seen: Seen | None,
                  gens: list[torch.Generator] | None) -> Verdict:
    """LOSSY, opt-in (`cfg.relaxed` > 0; after SpecDec's tolerance, Xia et al. 2023): a draft token x is accepted
    at its parent when log p(best) - log p(x) <= cfg.relaxed, p the target's distribution there (greedy: the
    penalised logits' softmax at temperature 1; sampling: the processed distribution). The deepest path of
    accepted tokens wins; the next token is the target's own (greedy: its argmax; sampling: drawn from p)."""
    batch = tree.tokens.shape[0]
    rows = torch.arange(batch, device=logits.device)
    processed = penalize(logits.float(), seen, cfg)                            # [B, N, V]
    if not cfg.greedy:
        processed = warp(processed, cfg)
    logp = processed.log_softmax(dim=-1)
    parent = tree.parents.clamp(min=0)                                         # [B, N]
    gap = logp.amax(dim=-1).gather(1, parent) - logp[rows[:, None], parent, tree.tokens]    # [B, N] nats
    best = _deepest(tree, tree.valid & (gap <= cfg.relaxed))                   # [B]
    nxt = processed[rows, best].argmax(dim=-1) if cfg.greedy else _sample_rows(
        logp[rows, best].exp(), gens, torch.ones(batch, dtype=torch.bool, device=logits.device))
    return Verdict(_path_to(tree, best), tree.depth[rows, best], nxt)


def _node_seen(tree: DraftTree, seen: Seen, vocab: int) -> Seen:
    """The Seen of the context ending at each node, [B, N, K] each over the K tokens that occur in some row's
    context or tree (no other logit is penalised, so only those columns are processed): the committed context's
    plus the tokens on the node's path. The root's token is the committed context's last: it adds to presence,
    never to counts."""
    touched = torch.zeros(vocab, dtype=torch.bool, device=tree.tokens.device)
    for dense in (seen.presence, None if seen.counts is None else seen.counts > 0):
        if dense is not None:
            touched |= dense.any(0)
    touched[tree.tokens.flatten()] = True
    cols = touched.nonzero().squeeze(1)                                        # [K] ascending
    at = torch.searchsorted(cols, tree.tokens)                                 # [B, N] each node's column
    onehot = torch.nn.functional.one_hot(at, cols.numel()).float() * tree.valid[..., None]   # [B, N, K]
    on_path = torch.bmm(tree.ancestors.float(), onehot)                        # [B, N, K] counts, root included
    presence = None if seen.presence is None else (on_path > 0) | seen.presence[:, cols][:, None, :]
    counts = None
    if seen.counts is not None:                                                # every node's path holds the root
        counts = on_path - onehot[:, :1] + seen.counts[:, cols][:, None, :]
    return Seen(presence, counts, cols)


def _path_to(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """Node ids from the root to `node` [B]: [B, D+1], -1 padded."""
    batch, n = tree.tokens.shape
    rows = torch.arange(batch, device=node.device)
    width = tree.max_depth + 1
    on_path = tree.ancestors[rows, node]                                       # [B, N]
    slot = torch.where(on_path, tree.depth, width)                             # off-path nodes go to a spare column
    path = torch.full((batch, width + 1), -1, dtype=torch.long, device=node.device)
    ids = torch.arange(n, device=node.device).expand(batch, n)
    path.scatter_(1, slot, torch.where(on_path, ids, -1))
    return path[:, :width]


def _greedy(tree: DraftTree, best_tok: torch.Tensor) -> Verdict:
    """best_tok: [B, N] the target's argmax at every node. Accept the deepest node whose whole path matches."""
    if tree.size == 1:             # a plain step: the root alone (no reads of the device on the way: see engine)
        root = torch.zeros_like(best_tok)                                      # [B, 1]
        return Verdict(root, root[:, 0], best_tok[:, 0])
    expected = best_tok.gather(1, tree.parents.clamp(min=0))                  # [B, N] argmax at each parent
    best = _deepest(tree, tree.valid & (tree.tokens == expected))              # [B]
    rows = torch.arange(best.shape[0], device=best.device)
    return Verdict(_path_to(tree, best), tree.depth[rows, best], best_tok[rows, best])


def _deepest(tree: DraftTree, match: torch.Tensor) -> torch.Tensor:
    """match: [B, N] bool, node passes its test. The deepest node whose whole path passes (ties: lowest id): [B]."""
    n = tree.tokens.shape[1]
    match = match.clone()
    match[:, 0] = True
    path_ok = ~(tree.ancestors & ~match[:, None, :]).any(dim=-1)               # [B, N]
    idx = torch.arange(n, device=match.device)
    score = torch.where(path_ok, tree.depth * n + (n - 1 - idx), -1)           # deepest, then lowest id
    return score.argmax(dim=1)


def _rejection(tree: DraftTree, p: torch.Tensor, gens: list[torch.Generator]) -> Verdict:
    """p: [B, N, V] processed target distributions. The walk described in the module docstring."""
    batch, n, vocab = p.shape
    device = p.device
    rows = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(tree.max_depth + 1):
        p_cur = p[rows, cur]                                                   # [B, V]
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for c in range(tree.children.shape[2]):
            child = tree.children[rows, cur, c]                                # [B]
            cand = ~done & ~moved & (child >= 0)
            if not bool(cand.any()):
                continue
            child = child.clamp(min=0)
            x = tree.tokens[rows, child]                                       # [B]
            if tree.q is None:
                q_row = torch.nn.functional.one_hot(x, vocab).to(p.dtype)      # [B, V] point mass
            else:
                q_row = tree.q[rows, child].to(p.dtype)
            ratio = p_cur[rows, x] / q_row[rows, x].clamp(min=1e-30)
            acc = cand & (_uniform(gens, cand) < ratio)
            cur = torch.where(acc, child, cur)
            moved |= acc
            rej = cand & ~acc
            p_cur = torch.where(rej[:, None], _residual(p_cur, q_row), p_cur)
        finish = ~done & ~moved
        if bool(finish.any()):
            picked = _sample_rows(p_cur, gens, finish)
            next_token = torch.where(finish, picked, next_token)
            done |= finish
        if bool(done.all()):
            break
    return Verdict(_path_to(tree, cur), tree.depth[rows, cur], next_token)


def _block(tree: DraftTree, p: torch.Tensor, gens: list[torch.Generator]) -> Verdict:
    """Block verification (Sun et al. 2024) of chains of drawn drafts: the whole chain is judged jointly, which
    gives the target's law exactly and never fewer tokens on average than the walk of `_rejection` (more where
    the draft distribution q is soft; for point masses it is the same). p: [B, N, V] processed target
    distributions; tree: chains (one child at most per node), q set.

    With X_i the draft at depth i, p_i the target's and q_i the draft's distribution it was drawn against, and
    w_0 = 1: w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i)); r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)), and the
    chance to stop at depth i, h_i = r_i / (r_i + 1 - w_i) (h_L = w_L at the chain's end L). With one uniform
    u_i per depth, the deepest i with u_i <= h_i is kept (0 if none); the next token is drawn from p_{L+1} after a
    full chain, else from norm(max(0, w_i p_{i+1} - q_{i+1}))."""
    batch = p.shape[0]
    rows = torch.arange(batch, device=p.device)
    nodes = _chain_nodes(tree)                                                 # [B, D+1], -1 past a row's end
    length = (nodes >= 0).sum(dim=1) - 1                                       # [B] draft tokens per row
    at = nodes.clamp(min=0)
    p_after = p[rows[:, None], at].double()                                    # [B, D+1, V] p_{i+1}: after depth i
    q_of = tree.q[rows[:, None], at].double()                                  # [B, D+1, V] q_i: drew depth i
    x = tree.tokens.gather(1, at)                                              # [B, D+1]
    depth = nodes.shape[1] - 1
    w = [torch.ones(batch, dtype=torch.float64, device=p.device)]
    for i in range(1, depth + 1):
        ratio = p_after[rows, i - 1, x[:, i]] / q_of[rows, i, x[:, i]].clamp(min=1e-300)
        w.append(torch.minimum(w[-1] * ratio, torch.ones_like(ratio)))
    kept = torch.zeros(batch, dtype=torch.long, device=p.device)
    for i in range(1, depth + 1):
        live = i <= length
        if not bool(live.any()):
            break
        nxt = min(i + 1, depth)
        r = (w[i][:, None] * p_after[:, i] - q_of[:, nxt]).clamp(min=0).sum(-1)  # [B]
        denom = r + 1 - w[i]
        h = torch.where(denom > 0, r / denom.clamp(min=1e-300), torch.ones_like(r))
        h = torch.where(i == length, w[i], h)                                  # the chain's end: h_L = w_L
        u = _uniform(gens, live).double()
        kept = torch.where(live & (u <= h), torch.full_like(kept, i), kept)
    w_kept = torch.stack(w, dim=1)[rows, kept]                                 # [B]
    after = p_after[rows, kept]                                                # [B, V]
    drew = q_of[rows, (kept + 1).clamp(max=depth)]                             # [B, V]
    probs = torch.where((kept == length)[:, None], after, _residual(w_kept[:, None] * after, drew, after))
    nxt_token = _sample_rows(probs.to(p.dtype), gens, torch.ones(batch, dtype=torch.bool, device=p.device))
    return Verdict(_path_to(tree, nodes[rows, kept]), kept, nxt_token)


def _chain_nodes(tree: DraftTree) -> torch.Tensor:
    """The node at each depth of each row's chain: [B, D+1] (the root first), -1 past the row's end."""
    rows = torch.arange(tree.tokens.shape[0], device=tree.tokens.device)
    nodes = [torch.zeros_like(rows)]
    for _ in range(tree.max_depth):
        up = nodes[-1]
        nodes.append(torch.where(up >= 0, tree.children[rows, up.clamp(min=0), 0], -1))
    return torch.stack(nodes, dim=1)


def _soft_chains(tree: DraftTree) -> torch.Tensor:
    """[B] rows whose draft is a chain (one child per node at most) with a drawn token in it (q below 1 at its own
    token). The others keep `_rejection`'s walk: for point masses the two rules agree in law, and a row's random
    draws must not depend on whether another row of its batch drew its drafts (which is what gives a tree its q)."""
    chain = (tree.children[:, :, 1:] < 0).all(dim=2).all(dim=1)                # [B]
    own = tree.q.gather(2, tree.tokens[..., None])[..., 0]                      # [B, N] q at each node's token
    drawn = (tree.valid & (own < 1))[:, 1:].any(dim=1)                          # [B] (the root is not drawn)
    return chain & drawn


def _take(tree: DraftTree, rows: torch.Tensor) -> DraftTree:
    """The trees of these rows only."""
    return DraftTree(*(None if t is None else t[rows] for t in (
        tree.tokens, tree.parents, tree.valid, tree.q, tree.depth, tree.ancestors, tree.children)))


def _merge(parts: list[tuple[torch.Tensor, Verdict]], tree: DraftTree) -> Verdict:
    """The verdicts of row subsets (rows [b], Verdict) as one over the whole batch of `tree`."""
    batch, width = tree.tokens.shape[0], tree.max_depth + 1
    device = tree.tokens.device
    path = torch.full((batch, width), -1, dtype=torch.long, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    nxt = torch.zeros(batch, dtype=torch.long, device=device)
    for rows, v in parts:
        path[rows, : v.path.shape[1]] = v.path
        accepted[rows], nxt[rows] = v.accepted, v.next_token
    return Verdict(path, accepted, nxt)


def _residual(p: torch.Tensor, q: torch.Tensor, empty: torch.Tensor | None = None) -> torch.Tensor:
    """norm(max(p - q, 0)) per row [B, V]; where p <= q everywhere (only after an accept-for-sure) `empty` (default
    p). p may be a scaled distribution (block verification's w p)."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-300 if r.dtype == torch.float64 else 1e-30),
                       p if empty is None else empty)


def _uniform(gens: list[torch.Generator], rows: torch.Tensor) -> torch.Tensor:
    """A uniform draw for each selected row (others get 2.0, never accepted): [B]. Only selected rows consume
    randomness, so a row's stream does not depend on the rest of the batch."""
    out = torch.full((len(gens),), 2.0)
    for b in rows.nonzero().flatten().tolist():
        out[b] = torch.rand(1, generator=gens[b], device=gens[b].device).cpu()
    return out.to(rows.device)


def _sample_rows(probs: torch.Tensor, gens: list[torch.Generator], rows: torch.Tensor) -> torch.Tensor:
    """Sample one token for each selected row of probs [B, V]; others get 0. Returns [B] long."""
    out = torch.zeros(len(gens), dtype=torch.long, device=probs.device)
    chosen = rows.nonzero().flatten()
    if len(chosen):
        out[chosen] = row_sample(probs[chosen], [gens[b] for b in chosen.tolist()])
    return out
