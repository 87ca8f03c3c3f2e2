"""A draft tree per row: node 0 is the root (the pending token, already chosen but not yet in the KV cache);
every other node is a draft token with a parent. A chain is a tree whose nodes have one child.

Compiled once per step into what verification needs: ancestor mask (the 4-D attention mask of the tree part),
depths (position offsets), and a children table (for the acceptance walk).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor        # [B, N] long; node 0 is the root
    parents: torch.Tensor       # [B, N] long; -1 for the root and for padding nodes
    valid: torch.Tensor         # [B, N] bool; padding nodes (ragged trees in a batch) are False
    q: torch.Tensor | None      # [B, N, V] float: the draft distribution node i was drawn from; None = point mass
    depth: torch.Tensor         # [B, N] long; root 0
    ancestors: torch.Tensor     # [B, N, N] bool; ancestors[b, i, j]: j is i or an ancestor of i
    children: torch.Tensor      # [B, N, C] long; child node ids in sibling order, -1 padded

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


def build(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, q: torch.Tensor | None) -> DraftTree:
    """Compile a tree. tokens, parents, valid: [B, N]; parents[b, i] < i for every valid non-root node."""
    batch, n = tokens.shape
    assert parents.shape == (batch, n) and valid.shape == (batch, n)
    assert bool(valid[:, 0].all()), "the root must be valid"
    device = tokens.device
    parents = torch.where(valid, parents, torch.full_like(parents, -1))
    parents = parents.clone()
    parents[:, 0] = -1
    eye = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n)
    anc = eye.clone()
    depth = torch.zeros(batch, n, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    for i in range(1, n):  # parents precede children, so one pass in node order suffices
        p = parents[:, i]
        has = p >= 0
        p_safe = p.clamp(min=0)
        anc[:, i] = torch.where(has[:, None], anc[rows, p_safe] | eye[:, i], eye[:, i])
        depth[:, i] = torch.where(has, depth[rows, p_safe] + 1, depth[:, i])
    return DraftTree(tokens, parents, valid, q, depth, anc, _children(parents, valid))


def _children(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N] parents -> [B, N, C] children table in node order, -1 padded."""
    batch, n = parents.shape
    is_child = (parents[:, None, :] == torch.arange(n, device=parents.device)[None, :, None]) & valid[:, None, :]
    count = int(is_child.sum(-1).max()) if n > 1 else 0
    count = max(count, 1)
    # order children by node index: sort keys put non-children last
    keys = torch.where(is_child, torch.arange(n, device=parents.device), n)
    order = keys.sort(dim=-1).values[..., :count]
    return torch.where(order < n, order, torch.full_like(order, -1))


def chain(root: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
    """A chain per row: root [B], draft [B, K] (padded), lengths [B] valid draft tokens, q [B, K, V] or None.

    Built directly (no per-node loop): the ancestor mask of a chain is the lower triangle."""
    batch, k = draft.shape
    device = root.device
    if k == 0:                     # the root alone (a plain step): fewer small operations, each host time on a GPU
        tokens = root[:, None].clone()                                         # [B, 1]
        none = torch.full_like(tokens, -1)
        q = None if q is None else torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)     # as below
        return DraftTree(tokens, none, torch.ones_like(tokens, dtype=torch.bool), q, torch.zeros_like(tokens),
                         torch.ones(batch, 1, 1, dtype=torch.bool, device=device), none[..., None])
    tokens = torch.cat([root[:, None], draft], dim=1)
    idx = torch.arange(k + 1, device=device)
    valid = idx[None, :] <= lengths[:, None]                                   # [B, K+1]
    tril = torch.ones(k + 1, k + 1, dtype=torch.bool, device=device).tril()
    ancestors = tril[None] & valid[:, None, :] | torch.eye(k + 1, dtype=torch.bool, device=device)[None]
    parents = torch.where(valid, idx - 1, -1)
    nxt = idx + 1
    children = torch.where((nxt[None, :] <= lengths[:, None]), nxt, -1)[..., None]  # [B, K+1, 1]
    depth = torch.where(valid, idx, 0).expand(batch, k + 1)
    if q is not None:
        q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)
    return DraftTree(tokens, parents, valid, q, depth, ancestors, children)


def roots(pending: torch.Tensor) -> DraftTree:
    """Every row's root alone (a plain step): pending [B]."""
    return chain(pending, pending[:, None][:, :0], torch.zeros_like(pending))


def from_paths(root: torch.Tensor, paths: list[list[int]], tokens: torch.Tensor) -> DraftTree:
    """A static tree given as paths of child choices (Medusa style: [[0], [1], [0, 0], ...]).

    root: [B]; tokens: [B, N-1] the token of each non-root node in the order of `paths` (sorted so parents come
    first). Returns a tree whose node i+1 is paths[i]."""
    index = {(): 0}
    parents = [-1]
    for i, path in enumerate(paths):
        index[tuple(path)] = i + 1
        parent = tuple(path[:-1])
        if parent not in index:
            raise ValueError(f"tree path {path} appears before its parent {list(parent)}")
        parents.append(index[parent])
    batch = root.shape[0]
    par = torch.tensor(parents, device=root.device).expand(batch, -1).clone()
    toks = torch.cat([root[:, None], tokens], dim=1)
    return build(toks, par, torch.ones_like(toks, dtype=torch.bool), None)


def from_sequences(root: torch.Tensor, sequences: list[list[list[int]]]) -> DraftTree:
    """A point-mass tree per row from candidate continuations of the root, shared prefixes merged (a trie).

    root: [B]; sequences[b]: row b's candidates, each a list of draft tokens (may be empty). Siblings are in the
    order their first candidate came, so earlier candidates are tried first."""
    return graft(roots(root), sequences)


def graft(tree: DraftTree, sequences: list[list[list[int]]]) -> DraftTree:
    """tree [B, N] with, per row, point-mass continuations of the root merged in as trie paths: where the tree
    already holds a prefix of a candidate in sequences[b], its nodes are reused; the rest are new nodes after the
    tree's N (node ids below N keep their meaning), each the last child of its parent when added, in the order
    the candidates come. Under sampling (tree.q given) a new node's q is a point mass on its token: a sibling
    drawn deterministically after the drawn ones keeps the recursive rejection rule exact."""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    n = tree.tokens.shape[1]
    added = []                                   # per row: (token, parent) of the new nodes, in order
    for b, candidates in enumerate(sequences):
        child = {(parents[b][i], tokens[b][i]): i for i in range(1, n) if valid[b][i]}
        new = []
        for seq in candidates:
            node = 0
            for tok in seq:
                if (node, tok) not in child:
                    child[(node, tok)] = n + len(new)
                    new.append((tok, node))
                node = child[(node, tok)]
        added.append(new)
    m = max(len(a) for a in added)
    if m == 0:
        return tree
    device = tree.tokens.device
    extra_tok = torch.tensor([[t for t, _ in a] + [0] * (m - len(a)) for a in added], device=device)
    extra_par = torch.tensor([[p for _, p in a] + [-1] * (m - len(a)) for a in added], device=device)
    extra_valid = torch.tensor([[True] * len(a) + [False] * (m - len(a)) for a in added], device=device)
    q = tree.q
    if q is not None:   # [B, N + m, V]
        point = torch.nn.functional.one_hot(extra_tok, q.shape[-1]).to(q.dtype) * extra_valid[..., None]
        q = torch.cat([q, point], dim=1)
    return build(torch.cat([tree.tokens, extra_tok], 1), torch.cat([tree.parents, extra_par], 1),
                 torch.cat([tree.valid, extra_valid], 1), q)


def with_forced(tree: DraftTree, forced: list[list[int]] | None) -> DraftTree:
    """tree with, per row, the tokens its grammar forces next (StepContext.forced) grafted on as one chain of
    point masses (`graft`); the tree itself where nothing is forced."""
    if not forced or not any(forced):
        return tree
    return graft(tree, [[f] if f else [] for f in forced])


def first_branch(tree: DraftTree) -> DraftTree:
    """The tree cut to one chain per row: from the root, each kept node's first child (the drafter's likeliest),
    the other nodes made padding (node ids keep their meaning), for a target that verifies chains only."""
    batch, n = tree.tokens.shape
    if tree.children.shape[-1] == 1:                     # no node has two children: already chains
        return tree
    children = tree.children[..., 0].tolist()                                             # [B, N]
    keep = [[False] * n for _ in range(batch)]
    for b in range(batch):
        node = 0
        while node >= 0:
            keep[b][node] = True
            node = children[b][node]
    valid = tree.valid & torch.tensor(keep, device=tree.valid.device)
    return build(tree.tokens, tree.parents, valid, tree.q)


def best_chain(nodes: list) -> list:
    """Ranked tree nodes (path, chance, anything; most likely first, parents before children) cut to one chain:
    the likeliest first node, then its likeliest child, and so on. For a target that verifies one chain per row
    (StepContext.chains_only), where the other branches would be dropped before verification."""
    out, end = [], ()
    while True:
        node = next((x for x in nodes if len(x[0]) == len(end) + 1 and x[0][:-1] == end), None)
        if node is None:
            return out
        out.append(node)
        end = node[0]
