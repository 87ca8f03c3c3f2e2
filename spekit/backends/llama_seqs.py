"""Attention sets as llama.cpp sequence ids: how one decode call verifies a whole draft tree.

llama.cpp has no custom attention mask. A token in a batch sees the cache cells that hold its first sequence id
at a position no later than its own (the cells of the same batch included, once it has placed them), and a cell
may belong to several sequences. So a tree is drawn with one sequence per leaf: each node belongs to the
sequences of the leaves below it and names one of them first; it then sees its ancestors and itself, nothing
else. The committed context is copied into every sequence the step uses (`llama_memory_seq_cp`, which in a
unified cache only tags the cells).

`assign` does this for any causal attention pattern that can be drawn so (trees, chains, lookahead's side nodes),
pure Python, no llama.cpp: node i's first sequence must hold exactly the nodes i may see among those at its
position or before, and every sequence must hold one node per position, consecutive from the row's first new
position (llama.cpp refuses a batch whose sequence skips a position)."""
from __future__ import annotations


class NotDrawable(ValueError):
    """An attention pattern that sequence ids cannot express (a node that sees a later one, or a gap)."""


def assign(positions: list[int], allowed: list[list[bool]]) -> list[list[int]]:
    """Sequences for one row's new tokens.

    positions: [N] (-1: padding, no cell); allowed: [N][N], allowed[i][j] when token i may attend token j (i
    itself always may). Returns, per token, its sequence numbers (0, 1, ... in order of creation; the first one
    listed is the one it attends by), [] for padding. A chain, or any pattern in which one token sees all the
    others, gets the single sequence 0."""
    n = len(positions)
    real = [i for i in range(n) if positions[i] >= 0]
    if not real:
        return [[] for _ in range(n)]
    start = min(positions[i] for i in real)
    members: list[set[int]] = []          # per sequence: its tokens
    first: dict[int, int] = {}
    # latest position first: a token's sequence is made by the furthest token that sees it, or by itself
    for i in sorted(real, key=lambda k: -positions[k]):
        seen = {j for j in real if allowed[i][j]} | {i}
        if any(positions[j] > positions[i] or (positions[j] == positions[i] and j != i) for j in seen):
            raise NotDrawable(f"token {i} may attend a token at its own position or later")
        found = next((s for s, m in enumerate(members)
                      if i in m and {j for j in m if positions[j] <= positions[i]} == seen), None)
        if found is None:
            spots = sorted(positions[j] for j in seen)
            if spots != list(range(start, positions[i] + 1)):
                raise NotDrawable(f"token {i} sees positions {spots}, not each of {start}..{positions[i]} once")
            members.append(seen)
            found = len(members) - 1
        first[i] = found
    out: list[list[int]] = [[] for _ in range(n)]
    for i in real:
        out[i] = [first[i]] + [s for s, m in enumerate(members) if i in m and s != first[i]]
    return out


def is_chain(positions: list[int], allowed: list[list[bool]]) -> bool:
    """Whether the real tokens, in position order, each see all earlier ones (one sequence draws them), at
    consecutive positions: the common case (plain steps, chains of drafts, prompts), checked without `assign`."""
    real = sorted((p, i) for i, p in enumerate(positions) if p >= 0)
    for k, (p, i) in enumerate(real):
        if k and p != real[k - 1][0] + 1:
            return False
        if not all(allowed[i][j] for _, j in real[:k]) or any(allowed[i][j] for _, j in real[k + 1:]):
            return False
    return True
