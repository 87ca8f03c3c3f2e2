"""The decider's guarantees.

1. Lossless: whatever the draft (a chain or a tree; soft, drawn from q, or point mass; ragged), the tokens that come
   out of `verify` follow the target's processed distribution exactly. Checked empirically on the joint
   distribution of the first two output tokens, many trials at once (one trial per batch row, each with its own
   generator, its draft re-drawn from q), against the exact distribution.
2. Greedy is the temperature-0 case of the same rule: the `_greedy` fast path returns exactly what `_rejection`
   returns, and only ever emits the target's argmax.
3. A Verdict is a root-to-node path of the tree; accepted == path length - 1.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from spekit import acceptance
from spekit.config import SamplingConfig
from spekit.sampling import Seen, make_generators, penalize, target_probs, warp
from spekit.tree import build, chain, from_paths

V = 6            # vocabulary of the synthetic worlds: 36 outcomes for two tokens
TRIALS = 10_000
ROOT = 0


# --- a synthetic world: target logits and draft distributions that depend on the path, like a real model ---

class World:
    """Target logits and draft distributions as functions of the tokens after the root (depth <= 2)."""

    def __init__(self, seed: int, cfg: SamplingConfig):
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.L0 = torch.randn(V, generator=g)                      # [V]        logits at the root
        self.L1 = torch.randn(V, V, generator=g) * 2 + 3 * torch.eye(V)   # [V, V]  after token a; likes repeats,
                                                                   # so the penalty on path tokens matters
        self.L2 = torch.randn(V, V, V, generator=g) * 2            # [V, V, V]  logits after a, b
        self.Q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)      # [V]     draft at the root
        self.Q1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)   # [V, V]  draft after token a
        self.context = torch.zeros(V, dtype=torch.bool)            # [V] tokens of the committed context
        self.context[[ROOT, 3]] = True
        self.counts = torch.zeros(V)                                # [V] their counts among the generated tokens
        self.counts[[ROOT, 3]] = torch.tensor([1.0, 2.0])
        self.L0[self.context] -= 1.5          # the likely first tokens are new ones: their repeats get penalised
        eye = torch.eye(V, dtype=torch.bool)
        self.p0 = target_probs(self.L0, cfg, Seen(self.context, self.counts))                          # [V]
        self.p1 = target_probs(self.L1, cfg, Seen(self.context[None] | eye, self.counts[None] + eye))  # p(b | a)

    def joint(self) -> torch.Tensor:
        """Exact target distribution of the first two tokens: [V, V]."""
        return self.p0[:, None] * self.p1

    def draft_joint(self) -> torch.Tensor:
        """What a decider that accepts every (soft) draft token would produce: [V, V]."""
        return self.Q0[:, None] * self.Q1


def node_layout(branching: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Parents and depths in breadth-first order for a tree where every depth-d node has branching[d] children."""
    parents, depth, level = [-1], [0], [0]
    for d, k in enumerate(branching):
        nxt = []
        for p in level:
            for _ in range(k):
                parents.append(p)
                depth.append(d + 1)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents, depth


def draw_tree(world: World, branching: tuple[int, ...], soft: bool, ragged: bool, trials: int, g: torch.Generator):
    """`trials` trees of one shape: tokens [B, N], parents [B, N], valid [B, N], q [B, N, V] or None, depth [N].
    Soft: every node drawn from the draft distribution at its parent (siblings i.i.d.). Point mass: fixed distinct
    siblings, a mix of likely and unlikely target tokens (so both acceptances and rejections happen)."""
    parents, depth = node_layout(branching)
    n = len(parents)
    tokens = torch.full((trials, n), ROOT, dtype=torch.long)
    q = torch.zeros(trials, n, V) if soft else None
    rank = [1, 0, 4, 2]                                             # which target rank each sibling gets
    for i in range(1, n):
        par, d = parents[i], depth[i]
        sibling = sum(1 for j in range(1, i) if parents[j] == par)
        if soft:
            dist = world.Q0.expand(trials, V) if d == 1 else world.Q1[tokens[:, par]]    # [B, V]
            tokens[:, i] = torch.multinomial(dist, 1, generator=g)[:, 0]
            q[:, i] = dist
        else:
            p = world.p0.expand(trials, V) if d == 1 else world.p1[tokens[:, par]]      # [B, V]
            tokens[:, i] = p.argsort(dim=-1, descending=True)[:, rank[sibling]]
    par_t = torch.tensor(parents).expand(trials, n).clone()
    valid = torch.ones(trials, n, dtype=torch.bool)
    if ragged:  # drop random nodes together with their subtrees
        drop = torch.rand(trials, n, generator=g) < 0.35
        drop[:, 0] = False
        for i in range(1, n):
            valid[:, i] = ~drop[:, i] & valid[:, parents[i]]
    return tokens, par_t, valid, q, torch.tensor(depth)


def node_logits(world: World, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Target logits at every node: [B, N, V]."""
    b, n = tokens.shape
    out = torch.empty(b, n, V)
    for i in range(n):
        if depth[i] == 0:
            out[:, i] = world.L0
        elif depth[i] == 1:
            out[:, i] = world.L1[tokens[:, i]]
        else:
            out[:, i] = world.L2[tokens[:, parents[0, i]], tokens[:, i]]
    return out


def check_verdict(tree, verdict) -> None:
    """A verdict is a path from the root down the tree's parent links over valid nodes."""
    path, acc = verdict.path, verdict.accepted
    rows = torch.arange(path.shape[0])
    assert bool((path[:, 0] == 0).all())
    on = path >= 0
    assert torch.equal(acc, on.sum(1) - 1)
    assert bool((on[:, 1:] <= on[:, :-1]).all()), "the path is a prefix, -1 padded"
    for k in range(1, path.shape[1]):
        live = on[:, k]
        node = path[live, k]
        assert torch.equal(tree.parents[rows[live], node], path[live, k - 1])
        assert bool(tree.valid[rows[live], node].all())
        assert bool((tree.depth[rows[live], node] == k).all())


def first_two(world: World, tree, verdict, g: torch.Generator) -> torch.Tensor:
    """The first two output tokens of each trial: [B, 2]. When the step emitted only one token, the second is
    drawn from the exact target conditional (what the next step would be checked against)."""
    rows = torch.arange(verdict.path.shape[0])
    acc = verdict.accepted
    width = verdict.path.shape[1]

    def node(k: int) -> torch.Tensor:                      # [B] the k-th path node (clamped: masked below)
        return verdict.path[:, min(k, width - 1)].clamp(min=0)

    tok1 = torch.where(acc >= 1, tree.tokens[rows, node(1)], verdict.next_token)
    tok2 = torch.where(acc >= 2, tree.tokens[rows, node(2)], verdict.next_token)
    fresh = torch.multinomial(world.p1[tok1], 1, generator=g)[:, 0]
    tok2 = torch.where(acc == 0, fresh, tok2)
    return torch.stack([tok1, tok2], dim=1)


CONFIGS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.6": SamplingConfig(temperature=0.6),
    "top_k": SamplingConfig(temperature=1.0, top_k=3),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.7),
    "min_p": SamplingConfig(temperature=1.0, min_p=0.2),
    "penalty": SamplingConfig(temperature=1.0, repetition_penalty=2.0),
    "all": SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.5),
    # OpenAI's penalties over the generated tokens and a logit bias that bans token 4 and favours token 2
    "openai": SamplingConfig(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.7,
                             logit_bias=((2, 1.0), (4, -100.0))),
}
SHAPES = {  # name: (branching, soft draft, ragged)
    "chain_soft": ((1, 1), True, False),
    "chain_point": ((1, 1), False, False),
    "chain_point_ragged": ((1, 1), False, True),
    "tree_soft": ((3, 2), True, False),
    "tree_point": ((3, 2), False, False),
    "tree_soft_ragged": ((3, 2), True, True),
}
CASES = ([(shape, "t1") for shape in SHAPES] + [(shape, "all") for shape in SHAPES]
         + [("tree_soft", c) for c in CONFIGS if c not in ("t1", "all")] + [("tree_point", "penalty")]
         + [("tree_point", "openai"), ("chain_soft", "openai")])


def run_world(shape: str, config: str, seed: int = 0, trials: int = TRIALS):
    branching, soft, ragged = SHAPES[shape]
    world = World(seed, CONFIGS[config])
    g = torch.Generator().manual_seed(seed + 100)
    tokens, parents, valid, q, depth = draw_tree(world, branching, soft, ragged, trials, g)
    tree = build(tokens, parents, valid, q)
    logits = node_logits(world, tokens, parents, depth)                      # [B, N, V]
    seen = Seen(world.context.expand(trials, V), world.counts.expand(trials, V))
    verdict = acceptance.verify(tree, logits, world.cfg, seen, make_generators(list(range(trials))))
    return world, tree, logits, verdict, g


@pytest.mark.parametrize("shape,config", CASES)
def test_output_follows_the_target_distribution(follows, shape, config):
    world, tree, _, verdict, g = run_world(shape, config)
    check_verdict(tree, verdict)
    rate = float(verdict.accepted.float().mean())
    assert 0.1 < rate < 1.9, "both acceptances and rejections must happen for the test to mean much"
    wrong = world.draft_joint().flatten() if SHAPES[shape][1] else None
    two = first_two(world, tree, verdict, g)
    follows(two[:, 0] * V + two[:, 1], world.joint().flatten(), wrong)


def test_chain_acceptance_rate_is_optimal():
    """A single soft draft token is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    world = World(1, CONFIGS["t1"])
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(world.Q0.expand(TRIALS, V), 1, generator=g)[:, 0]
    tree = chain(torch.full((TRIALS,), ROOT), x[:, None], torch.ones(TRIALS, dtype=torch.long),
                 world.Q0.expand(TRIALS, 1, V))
    logits = torch.stack([world.L0.expand(TRIALS, V), world.L1[x]], dim=1)
    verdict = acceptance.verify(tree, logits, world.cfg, None, make_generators(list(range(TRIALS))))
    check_verdict(tree, verdict)
    rate = float(verdict.accepted.float().mean())
    assert abs(rate - float(torch.minimum(world.p0, world.Q0).sum())) < 0.015


def test_point_mass_draft_is_accepted_with_its_target_probability():
    world = World(2, CONFIGS["t1"])
    x = int(world.p0.argsort()[V // 2])
    n = 10_000
    tree = chain(torch.full((n,), ROOT), torch.full((n, 1), x), torch.ones(n, dtype=torch.long))
    logits = torch.stack([world.L0.expand(n, V), world.L1[x].expand(n, V)], dim=1)
    verdict = acceptance.verify(tree, logits, world.cfg, None, make_generators(list(range(n))))
    assert abs(float(verdict.accepted.float().mean()) - float(world.p0[x])) < 0.02
    # after a rejection the recovered token is never the rejected one
    assert bool((verdict.next_token[verdict.accepted == 0] != x).all())


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    """Each row consumes only its own generator: a row verified alone gives what it gives in the batch."""
    world, tree, logits, verdict, _ = run_world("tree_soft_ragged", "all", seed=3, trials=12)
    for r in range(12):
        one = build(tree.tokens[r:r + 1], tree.parents[r:r + 1], tree.valid[r:r + 1], tree.q[r:r + 1])
        alone = acceptance.verify(one, logits[r:r + 1], world.cfg, Seen(world.context[None], world.counts[None]),
                                  make_generators([r]))
        width = alone.path.shape[1]
        assert alone.path[0].tolist() == verdict.path[r, :width].tolist()
        assert bool((verdict.path[r, width:] == -1).all())
        assert alone.next_token.item() == verdict.next_token[r].item()


# --- greedy: the fast path is the temperature-0 case of the rule ---

def random_trees(batch: int, n: int, vocab: int, distinct: bool, g: torch.Generator):
    """Random ragged trees (tokens, parents, valid); siblings get distinct tokens when `distinct`."""
    parents = torch.full((batch, n), -1, dtype=torch.long)
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    for b in range(batch):
        used: dict[int, list[int]] = {}
        for i in range(1, n):
            open_ = [p for p in range(i) if len(used.get(p, [])) < vocab]
            p = open_[int(torch.randint(len(open_), (1,), generator=g))]
            if distinct:
                free = [t for t in range(vocab) if t not in used.get(p, [])]
                tokens[b, i] = free[int(torch.randint(len(free), (1,), generator=g))]
            used.setdefault(p, []).append(int(tokens[b, i]))
            parents[b, i] = p
    valid = torch.ones(batch, n, dtype=torch.bool)
    drop = torch.rand(batch, n, generator=g) < 0.15
    for i in range(1, n):
        valid[:, i] = ~drop[:, i] & valid[torch.arange(batch), parents[:, i]]
    return tokens, parents, valid


GREEDY = {
    "plain": SamplingConfig(temperature=0.0),
    "penalty": SamplingConfig(temperature=0.0, repetition_penalty=1.7),
    "openai": SamplingConfig(temperature=0.0, repetition_penalty=1.2, frequency_penalty=1.1, presence_penalty=0.4,
                             logit_bias=((1, 0.5),)),
}


@pytest.mark.parametrize("config", list(GREEDY))
@pytest.mark.parametrize("soft", [False, True], ids=["point", "soft_q"])
def test_greedy_fast_path_equals_the_rejection_rule(config, soft):
    cfg, vocab, batch, n = GREEDY[config], 4, 400, 9
    g = torch.Generator().manual_seed(5)
    tokens, parents, valid = random_trees(batch, n, vocab, distinct=True, g=g)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1) if soft else None
    tree = build(tokens, parents, valid, q)
    logits = torch.randn(batch, n, vocab, generator=g)
    counts = torch.randint(0, 3, (batch, vocab), generator=g).float()
    seen = Seen(torch.rand(batch, vocab, generator=g) < 0.3, counts)
    fast = acceptance.verify(tree, logits, cfg, seen, None)
    slow = acceptance.verify(tree, logits, cfg, seen, make_generators(list(range(batch))), fast_greedy=False)
    check_verdict(tree, fast)
    assert torch.equal(fast.path, slow.path)
    assert torch.equal(fast.accepted, slow.accepted)
    assert torch.equal(fast.next_token, slow.next_token)
    assert float(fast.accepted.float().mean()) > 0.5, "the test needs long accepted paths"
    assert_greedy_semantics(tree, logits, cfg, seen, fast)


def assert_greedy_semantics(tree, logits, cfg, seen, verdict) -> None:
    """Every emitted token is the target's argmax at the node before it (penalised with that node's own context:
    the committed tokens, the root's among them, and the path down to it), and the path stops only where no valid
    child matches."""
    vocab = logits.shape[-1]
    for b in range(tree.tokens.shape[0]):
        path = [j for j in verdict.path[b].tolist() if j >= 0]
        presence = torch.zeros(vocab, dtype=torch.bool) if seen is None else seen.presence[b].clone()
        counts = torch.zeros(vocab) if seen is None else seen.counts[b].clone()
        best = []
        for node in path:
            presence[tree.tokens[b, node]] = True
            if node != 0:
                counts[tree.tokens[b, node]] += 1
            best.append(int(target_probs(logits[b, node], cfg, Seen(presence, counts)).argmax()))
        assert tree.tokens[b, path[1:]].tolist() == best[:-1]
        assert verdict.next_token[b] == best[-1]
        kids = [c for c in tree.children[b, path[-1]].tolist() if c >= 0 and tree.valid[b, c]]
        assert all(tree.tokens[b, c] != best[-1] for c in kids)


def test_greedy_with_duplicate_siblings_emits_only_argmax_tokens():
    """Siblings with equal tokens (not produced by the built-in proposers) still yield greedy output on both paths,
    though the two may choose different (equally valid) branches."""
    cfg, batch = GREEDY["plain"], 300
    g = torch.Generator().manual_seed(6)
    tokens, parents, valid = random_trees(batch, 9, 3, distinct=False, g=g)
    tree = build(tokens, parents, valid, None)
    logits = torch.randn(batch, 9, 3, generator=g)
    for fast in (True, False):
        verdict = acceptance.verify(tree, logits, cfg, None, make_generators(list(range(batch))), fast_greedy=fast)
        check_verdict(tree, verdict)
        assert_greedy_semantics(tree, logits, cfg, None, verdict)


def test_chain_and_from_paths_compile_like_build():
    """The chain and static-tree constructors agree with the general one."""
    g = torch.Generator().manual_seed(7)
    root = torch.tensor([1, 2, 3])
    draft = torch.randint(0, V, (3, 4), generator=g)
    lengths = torch.tensor([0, 2, 4])
    c = chain(root, draft, lengths)
    idx = torch.arange(5)
    valid = idx[None] <= lengths[:, None]
    ref = build(torch.cat([root[:, None], draft], 1), (idx - 1).expand(3, 5), valid, None)
    for name in ("valid", "parents", "depth"):
        assert torch.equal(getattr(c, name), getattr(ref, name)), name
    assert torch.equal(c.ancestors & valid[:, :, None], ref.ancestors & valid[:, :, None])
    assert torch.equal(c.children, ref.children)

    paths = [[0], [1], [0, 0], [0, 1], [1, 0]]
    t = from_paths(root, paths, torch.randint(0, V, (3, 5), generator=g))
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 1, 2]
    assert t.depth[0].tolist() == [0, 1, 1, 2, 2, 2]
    assert t.children[0, 1].tolist() == [3, 4]
    with pytest.raises(ValueError):
        from_paths(root, [[0, 0], [0]], torch.zeros(3, 2, dtype=torch.long))


def test_graft_shares_prefixes_and_keeps_the_tree_s_node_ids():
    """A lookup chain merged into a tree: nodes the tree has are reused, new ones come after the tree's, each the
    last child of its parent; under sampling they carry a point-mass q."""
    from spekit.tree import graft
    root = torch.tensor([5, 6])
    q = torch.rand(2, 3, 4).softmax(-1)                                # [B, K, V]: a chain of 3 per row
    tree = chain(root, torch.tensor([[1, 2, 3], [1, 0, 0]]), torch.tensor([3, 1]), q=q)
    merged = graft(tree, [[[1, 2, 0, 1]], [[2]]])
    assert merged.size == 4 + 2
    assert merged.tokens[0, :4].tolist() == tree.tokens[0].tolist()
    assert merged.tokens[0, 4:].tolist() == [0, 1] and merged.parents[0, 4:].tolist() == [2, 4]
    assert merged.tokens[1, 4].item() == 2 and merged.parents[1, 4].item() == 0
    assert not bool(merged.valid[1, 5])
    assert merged.children[0, 2].tolist()[:2] == [3, 4]                # the new sibling after the tree's own
    assert merged.q[0, 4].tolist() == [1.0, 0.0, 0.0, 0.0] and merged.q[1, 4].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert graft(tree, [[[1, 2]], [[1]]]) is tree                          # nothing new: the same tree


# --- block verification (Sun et al. 2024): chains of drawn drafts judged jointly ---

class DeepWorld:
    """Target and draft distributions over V3 tokens that depend on the whole path, for chains of DEPTH drafts."""
    V3, DEPTH = 3, 3

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        shape = lambda d: (self.V3,) * d + (self.V3,)        # noqa: E731  distributions after d tokens
        self.p = [torch.softmax(torch.randn(shape(d), generator=g) * 1.5, -1) for d in range(self.DEPTH + 1)]
        self.q = [torch.softmax(torch.randn(shape(d), generator=g) * 1.5, -1) for d in range(self.DEPTH)]

    def at(self, table: list[torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
        """prefix [B, d] -> the distributions after it [B, V3]."""
        out = table[prefix.shape[1]]
        return out.expand(prefix.shape[0], -1) if prefix.shape[1] == 0 else out[tuple(prefix.t())]

    def run(self, trials: int, verification: str, seed: int = 0):
        """Draw chains, verify them; returns (outputs [B, DEPTH+1] completed from the target, accepted [B])."""
        g = torch.Generator().manual_seed(seed)
        draft = torch.zeros(trials, 0, dtype=torch.long)
        q = []
        for _ in range(self.DEPTH):
            dist = self.at(self.q, draft)
            q.append(dist)
            draft = torch.cat([draft, torch.multinomial(dist, 1, generator=g)], dim=1)
        tree = chain(torch.zeros(trials, dtype=torch.long), draft, torch.full((trials,), self.DEPTH),
                     torch.stack(q, dim=1))
        logits = torch.stack([self.at(self.p, draft[:, :d]).log() for d in range(self.DEPTH + 1)], dim=1)
        cfg = SamplingConfig(temperature=1.0, verification=verification)
        verdict = acceptance.verify(tree, logits, cfg, None, make_generators(list(range(trials))))
        check_verdict(tree, verdict)
        out = torch.zeros(trials, self.DEPTH + 1, dtype=torch.long)
        for b in range(trials):
            k = int(verdict.accepted[b])
            out[b, :k + 1] = torch.cat([draft[b, :k], verdict.next_token[b:b + 1]])
            for d in range(k + 1, self.DEPTH + 1):          # the rest as later steps would draw it: the target's law
                out[b, d] = torch.multinomial(self.at(self.p, out[b:b + 1, :d])[0], 1, generator=g)
        return out, verdict.accepted

    def law(self) -> torch.Tensor:
        """The target's exact law of DEPTH + 1 tokens, flattened [V3 ** (DEPTH + 1)]."""
        joint = self.p[0]
        for d in range(1, self.DEPTH + 1):
            joint = joint[..., None] * self.p[d]
        return joint.flatten()


@pytest.mark.parametrize("verification", ["block", "token"])
def test_deep_chains_follow_the_target_law(follows, verification):
    """Four tokens' joint law after chains of three drawn drafts, under either rule (block verification's stop
    chances use the distributions one depth further, so depth 2 alone would not exercise them all)."""
    world = DeepWorld(7)
    out, accepted = world.run(20_000, verification)
    assert 0.3 < float(accepted.float().mean()) < 2.7
    codes = ((out[:, 0] * 3 + out[:, 1]) * 3 + out[:, 2]) * 3 + out[:, 3]
    follows(codes, world.law())


def test_block_verification_keeps_more_than_token_by_token():
    """The paper's example: target (1/3, 2/3) and draft (2/3, 1/3) after every prefix, chains of two drafts. Token
    by token keeps 10/9 drafts a step on average, block verification 11/9 (the most any exact rule can keep)."""
    trials = 30_000
    p, q = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    g = torch.Generator().manual_seed(0)
    draft = torch.multinomial(q.expand(trials, 2), 2, replacement=True, generator=g)
    tree = chain(torch.zeros(trials, dtype=torch.long), draft, torch.full((trials,), 2), q.expand(trials, 2, 2))
    logits = p.log().expand(trials, 3, 2)
    kept = {rule: float(acceptance.verify(tree, logits, SamplingConfig(temperature=1.0, verification=rule), None,
                                          make_generators(list(range(trials)))).accepted.float().mean())
            for rule in ("token", "block")}
    assert abs(kept["token"] - 10 / 9) < 0.015 and abs(kept["block"] - 11 / 9) < 0.015, kept


def test_point_mass_chains_draw_alike_with_or_without_q():
    """A batch gets a q when some row drew its drafts; a row of point masses in it must draw its random numbers
    as it would alone (without q), or its sample would depend on its batch."""
    world, n = World(4, CONFIGS["t1"]), 64
    g = torch.Generator().manual_seed(4)
    draft = torch.randint(0, V, (n, 2), generator=g)
    lengths = torch.randint(0, 3, (n,), generator=g)
    logits = node_logits(world, torch.cat([torch.zeros(n, 1, dtype=torch.long), draft], 1),
                         torch.tensor([[-1, 0, 1]]).expand(n, 3), torch.tensor([0, 1, 2]))
    point = torch.nn.functional.one_hot(draft, V).float()
    verdicts = [acceptance.verify(chain(torch.zeros(n, dtype=torch.long), draft, lengths, q), logits, world.cfg,
                                  None, make_generators(list(range(n)))) for q in (None, point)]
    assert torch.equal(verdicts[0].path, verdicts[1].path)
    assert torch.equal(verdicts[0].next_token, verdicts[1].next_token)


# --- the relaxed rule: LOSSY, opt-in ---

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_relaxed_rule_accepts_what_its_tolerance_allows(temperature):
    """Every accepted token is within `relaxed` nats of the target's best at its parent (penalised with that node's
    own path, as the exact rule), the path stops where no valid child is, it keeps at least what the exact rule
    keeps greedy, and the next token is the target's own (its argmax, or a token it can draw)."""
    vocab, batch, n, tol = 4, 300, 9, 0.7
    cfg = SamplingConfig(temperature=temperature, repetition_penalty=1.3, relaxed=tol)
    g = torch.Generator().manual_seed(11)
    tokens, parents, valid = random_trees(batch, n, vocab, distinct=True, g=g)
    tree = build(tokens, parents, valid, None)
    logits = torch.randn(batch, n, vocab, generator=g) * 2
    seen = Seen(torch.rand(batch, vocab, generator=g) < 0.3, None)
    verdict = acceptance.verify(tree, logits, cfg, seen, make_generators(list(range(batch))))
    check_verdict(tree, verdict)
    exact = acceptance.verify(tree, logits, dataclasses.replace(cfg, temperature=0.0, relaxed=0.0), seen, None)
    if temperature == 0:
        assert bool((verdict.accepted >= exact.accepted).all()) and verdict.accepted.sum() > exact.accepted.sum()
    for b in range(batch):
        path = [j for j in verdict.path[b].tolist() if j >= 0]
        presence = seen.presence[b].clone()
        for i, node in enumerate(path):
            presence[tree.tokens[b, node]] = True
            processed = penalize(logits[b, node], Seen(presence, None), cfg)
            logp = (processed if temperature == 0 else warp(processed, cfg)).log_softmax(-1)
            nxt = path[i + 1] if i + 1 < len(path) else None
            if nxt is not None:
                assert float(logp.max() - logp[tree.tokens[b, nxt]]) <= tol + 1e-6
            elif temperature == 0:
                assert verdict.next_token[b] == processed.argmax()
            else:
                assert logp[verdict.next_token[b]] > float("-inf")
        kids = [c for c in tree.children[b, path[-1]].tolist() if c >= 0 and tree.valid[b, c]]
        assert all(float(logp.max() - logp[tree.tokens[b, c]]) > tol for c in kids)


def test_relaxed_results_are_labelled_lossy(llama):
    """The engine marks every sequence of a drafting method under the relaxed rule lossy; plain stays exact."""
    from conftest import make_engine
    cfg = SamplingConfig(max_new_tokens=12, relaxed=1.0)
    for method, lossless in (("plain", True), ("ngram", False)):
        result = make_engine(method, llama).generate([[1, 2, 3, 1, 2, 3, 1, 2]], cfg)[0]
        assert result.stats.lossless is lossless and result.as_dict()["lossless"] is lossless
