"""No host synchronisation inside the drafters' per-token loops. On CUDA every read of a device tensor (`.item()`,
`bool()`, `.tolist()`, ...) and every copy of host data to the device (`torch.tensor(list, device=...)`) makes the
host wait for the device; the tests count them in one `propose` on the CPU, with the early stop switched off as it
is off the CPU (`proposers.base.FREE_READS`):

- the chain drafters (draft, early-exit, mtp) do as many of them whatever the draft length;
- EAGLE's static tree does as many whatever its depth, its dynamic tree one read per level (the host decides how
  deep the tree grows, by design);
- the early stop the CPU keeps drafts exactly the trees the masked loop drafts without it, and saves forwards.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import spekit.pacing.pacer as pacer_module
import spekit.proposers.eagle as eagle_proposer
from spekit.proposers.eagle_growth import Growth
from spekit.config import SamplingConfig
from spekit.pacing.chains import ChainPacer
from spekit.pacing.step_costs import StepCosts
from spekit.backends.decoder_layers import Stack
from spekit import sampling
from spekit.proposers import base
from test_eagle import make_heads as eagle_heads
from test_mtp import make_heads as mtp_heads

aten = torch.ops.aten
# reads of a device tensor's values: a scalar (.item(), bool(), int(), float(); under inference mode they
# dispatch as item and is_nonzero), or an output whose size depends on the values
READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default,
         aten.equal.default}
PROMPTS = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10] * 5, [1, 2]]
GREEDY = SamplingConfig(max_new_tokens=12)
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=3)


class _Dispatched(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.counts["reads"] += 1
        elif func is aten.lift_fresh.default:          # torch.tensor(host data): a copy to the device
            self.counts["copies"] += 1
        return func(*args, **(kwargs or {}))


class _Called(TorchFunctionMode):
    """.tolist() of a CPU tensor does not dispatch; the function mode sees the call."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.counts["reads"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs():
    """Counts what would make the host wait for the device on CUDA: {"reads": n, "copies": m}."""
    counts = Counter()
    with _Called(counts), _Dispatched(counts):
        yield counts


def spy(engine) -> list[Counter]:
    """The host syncs of each of the engine's proposes, with its batch size and the depth of its tree."""
    calls, inner = [], engine.proposer.propose

    def propose(ctx):
        calls.append(Counter(batch=len(ctx.tokens)))
        with host_syncs() as counts:
            tree = inner(ctx)
        calls[-1].update(counts, depth=int(tree.depth.masked_fill(~tree.valid, 0).max()))
        return tree
    engine.proposer.propose = propose
    return calls


def by_batch(calls: list[Counter]) -> dict[int, set[tuple[int, int]]]:
    """The (reads, copies) the proposes of each batch size made (rows leave the batch as they finish)."""
    out: dict[int, set[tuple[int, int]]] = {}
    for c in calls:
        out.setdefault(c["batch"], set()).add((c["reads"], c["copies"]))
    return out


def same_syncs(short: list[Counter], long: list[Counter]) -> None:
    """Proposes of a batch size made the same syncs every time, and as many for long drafts as for short ones. The
    first propose of a run is left out: a head's own cache creates its layers then (transformers' DynamicLayer)."""
    a, b = by_batch(short[1:]), by_batch(long[1:])
    assert all(len(v) == 1 for v in [*a.values(), *b.values()]), (a, b)
    shared = a.keys() & b.keys()
    assert shared and all(a[n] == b[n] for n in shared), (a, b)


@pytest.fixture
def as_on_cuda(monkeypatch):
    """No early stop (it reads a device tensor), the device's own argmax (the host's numpy scan is for host
    tensors), drafts cost nothing and verifying k tokens costs what one does."""
    monkeypatch.setattr(base, "FREE_READS", ())
    monkeypatch.setattr(sampling, "argmax", lambda x: x.argmax(dim=-1))
    monkeypatch.setattr(Stack, "relative_cost", lambda self, layers: 0.0)
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)


def fixed_widths(monkeypatch, k: int) -> None:
    """Every chain drafter's row drafts k tokens (less the row's index, so rows stop apart), also rows ahead of
    the others in their batch (which the pacer otherwise gives no room: pacer.behind)."""
    monkeypatch.setattr(pacer_module, "behind", lambda left, room: list(range(len(room))))
    monkeypatch.setattr(ChainPacer, "widths", lambda self, room, *args: [min(max(k - b, 1), r)
                                                                         for b, r in enumerate(room)])


def chain_engine(engine_for, method: str, llama, llama_draft, k: int):
    if method == "draft":
        return engine_for("draft", llama, llama_draft, num_draft_tokens=k, max_draft_tokens=k, confidence=0.0)
    return engine_for("early-exit", llama, exit_layer=1, num_draft_tokens=k, max_draft_tokens=k, confidence=0.0)


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["draft", "early-exit"])
def test_a_chains_syncs_do_not_grow_with_its_length(engine_for, llama, llama_draft, as_on_cuda, monkeypatch,
                                                     method, cfg):
    seen = {}
    for k in (2, 8):
        fixed_widths(monkeypatch, k)
        calls = spy(eng := chain_engine(engine_for, method, llama, llama_draft, k))
        eng.generate(PROMPTS, cfg)
        assert {c["depth"] for c in calls} == {k}
        seen[k] = calls
    same_syncs(seen[2], seen[8])


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtps_syncs_do_not_grow_with_its_depth(engine_for, llama, as_on_cuda, tmp_path, cfg):
    heads = str(mtp_heads(llama, tmp_path / "mtp", modules=4))
    seen = {}
    for depth in (1, 4):
        calls = spy(eng := engine_for("mtp", llama, heads=heads, min_draft_tokens=depth, max_draft_tokens=depth))
        eng.generate(PROMPTS, cfg)
        assert {c["depth"] for c in calls} == {depth}
        seen[depth] = calls
    same_syncs(seen[1], seen[4])


def test_eagles_static_tree_syncs_do_not_grow_with_its_depth(engine_for, llama, as_on_cuda, tmp_path,
                                                             monkeypatch):
    heads = eagle_heads(llama, tmp_path, "eagle", sharpen=3.0)
    seen = {}
    for tree in (((0,), (1,), (0, 0)), eagle_proposer.STATIC_TREE):
        monkeypatch.setattr(eagle_proposer, "STATIC_TREE", tree)
        calls = spy(eng := engine_for("eagle", llama, heads=heads, tree="static"))
        eng.generate(PROMPTS, GREEDY)
        assert {c["depth"] for c in calls} == {len(tree[-1])}
        seen[len(tree[-1])] = calls
    same_syncs(seen[2], seen[5])


def test_eagles_dynamic_tree_reads_once_per_level(engine_for, llama, as_on_cuda, tmp_path, monkeypatch):
    """How deep the tree grows is the host's decision (it weighs the measured cost of each size): one read for
    each level the head drafts, beside those at the loop's ends."""
    heads, runs = eagle_heads(llama, tmp_path, "eagle", sharpen=3.0), []
    feed = Growth.feed

    def counted(self, nodes):
        runs[-1][-1]["levels"] += 1                    # the propose running now
        return feed(self, nodes)
    monkeypatch.setattr(Growth, "feed", counted)
    for depth in (2, 5):
        runs.append(spy(eng := engine_for("eagle", llama, heads=heads, tree="dynamic", depth=depth, branching=4,
                                          total_tokens=16, min_prob=0.0)))
        eng.generate(PROMPTS, GREEDY)
    drafted = [c for calls in runs for c in calls[1:] if c["depth"]]
    assert len({c["levels"] for c in drafted}) > 1, "every tree grew as deep: the test would not tell"
    assert len({c["reads"] - c["levels"] for c in drafted}) == 1, drafted


def counted_forwards(proposer) -> list[int]:
    """Counts the drafter's own forwards (the draft model's, or the target's layers run by early exit)."""
    owner, name = (proposer.draft, "forward") if proposer.draft is not None else (proposer.stack, "hidden")
    inner, count = getattr(owner, name), [0]

    def forward(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)
    setattr(owner, name, forward)
    return count


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["draft", "early-exit"])
def test_the_early_stop_drafts_the_same_trees(engine_for, small_target, small_drafts, monkeypatch, method, cfg):
    """The CPU stops a chain's loop once every row stopped (greedy: below `confidence`); off the CPU the stopped
    rows stay masked to the end. Same trees, same output; the early stop only saves forwards."""
    monkeypatch.setattr(Stack, "relative_cost", lambda self, layers: 0.0)
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0)
    fixed_widths(monkeypatch, 6)
    prompts = [[p % 8 for p in ids] for ids in PROMPTS]
    runs = []
    for free in (("cpu",), ()):
        monkeypatch.setattr(base, "FREE_READS", free)
        if method == "draft":
            eng = engine_for("draft", small_target, small_drafts["noisy_copy"], num_draft_tokens=6,
                             max_draft_tokens=6, confidence=0.9)
        else:
            eng = engine_for("early-exit", small_target, exit_layer=1, num_draft_tokens=6, max_draft_tokens=6,
                             confidence=0.9)
        trees, inner = [], eng.proposer.propose

        def propose(ctx, inner=inner, trees=trees):
            tree = inner(ctx)
            trees.append((tree.tokens.clone(), tree.valid.clone(), None if tree.q is None else tree.q.clone()))
            return tree
        eng.proposer.propose = propose
        forwards = counted_forwards(eng.proposer)
        out = [r.token_ids for r in eng.generate(prompts, cfg)]
        runs.append((out, trees, forwards[0]))
    (out, trees, stopped), (out_masked, trees_masked, masked) = runs
    assert out == out_masked
    assert len(trees) == len(trees_masked)
    for (tokens, valid, q), (tokens_m, valid_m, q_m) in zip(trees, trees_masked):
        assert torch.equal(tokens, tokens_m) and torch.equal(valid, valid_m)
        assert (q is None) == (q_m is None) and (q is None or torch.equal(q, q_m))
    if cfg.greedy:
        assert stopped < masked, "no step stopped early: the test would not tell"


def step_reads(engine) -> list[int]:
    """The reads of the device each of the engine's steps makes, drafting to observe (filled as it decodes)."""
    per_step, inner = [], engine._one_step

    def one_step(*args, **kwargs):
        with host_syncs() as counts:
            yield from inner(*args, **kwargs)
        per_step.append(counts["reads"])
    engine._one_step = one_step
    return per_step


@pytest.mark.parametrize("batch", [1, 3])
def test_a_plain_step_reads_only_its_next_tokens(engine_for, llama, batch):
    """A step without a draft (plain, or a drafter resting or held back) has nothing to roll back: the engine
    reads the device once, for the next tokens, where the tree machinery read it nine times (on an H200 spekit's
    plain step took 7 ms, 3.6 of them the replayed forward, the rest the host's small operations and reads)."""
    engine = engine_for("plain", llama)
    per_step = step_reads(engine)
    out = engine.generate(PROMPTS[:batch], GREEDY)
    assert per_step and set(per_step) == {1}
    assert all(len(r.token_ids) == GREEDY.max_new_tokens for r in out)


@pytest.mark.parametrize("draft", [2, 8])
def test_a_drafting_step_reads_the_device_three_times_whatever_its_size(engine_for, llama, draft, as_on_cuda):
    """The verdict's path, the tree's tokens, the next tokens and the depths come back in one read (they were
    four, and the roll-back read twice more); the check that no node passes the answer's end reads nothing until
    the end is nearer than the tree is big. What is left: the tree's depth for the path, the cache's hole count
    (compact), that one read."""
    engine = engine_for("ngram", llama, num_draft_tokens=draft)    # (its drafting reads nothing on the device)
    per_step = step_reads(engine)
    engine.generate(PROMPTS, SamplingConfig(max_new_tokens=24))
    assert 3 in per_step and set(per_step) <= {1, 3, 4}, per_step   # 4: near the end, a draft that may pass it
