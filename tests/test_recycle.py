"""Token recycling (`--method recycle`, and `rest --recycle K`): the adjacency table follows the target's own
top-k, the tree follows the table most likely first; greedy output equals plain greedy (alone, batched, up to the
context's end, under penalties, as a source of `rest`); sampled tokens follow the target's law; a sample never
depends on what the engine wrote before; it backs off where drafts do not pay."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from spekit import proposers
from spekit.config import SamplingConfig, UserError
from spekit.proposers import recycle
from spekit.proposers.recycle import Recycle, RecycleOptions, Recycler
from spekit.proposers.rest import Rest, RestOptions
from spekit.backends.torch_target import Target
from test_engine import DIST_CONFIGS, DIST_PROMPT, DIST_SAMPLES, V_SMALL, both_ways, first_two_exact
from conftest import PENALISED, penalised_greedy

DISTINCT = [5, 17, 42, 9, 3, 88, 61, 120, 33]
REPEATS = [7, 8, 9, 10] * 5
N = 32
MAX_POSITIONS = 512


def test_the_tree_follows_the_table_most_likely_first():
    r = Recycler({1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [8, 9]}, k=2)
    nodes = r.rank(1, size=5, depth=8)
    paths = [p for p, _, _ in nodes]
    assert paths[:2] == [(2,), (2, 4)], "rank 0 of depth 1, then its own rank-0 child (0.45^2 > 0.15)"
    assert all(len(p) == 1 or p[:-1] in paths[:i] for i, p in enumerate(paths)), "a parent before its children"
    chances = [c for _, c, _ in nodes]
    assert chances == sorted(chances, reverse=True) and len(nodes) == 5
    assert [p for p, _, _ in r.rank(1, size=10, depth=1)] == [(2,), (3,)]
    assert r.rank(99, size=10, depth=8) == [], "a token the target never ran on has no children"


def test_the_rates_learn_which_ranks_get_accepted():
    r = Recycler({}, k=2)
    before = r.chance(1, 0), r.chance(1, 1)
    for _ in range(30):
        r.plan = [((2,), 0), ((3,), 1), ((2, 4), 0)]
        r.learn([3, 11])                   # the rank-1 child accepted, then the target's own next token
    assert r.chance(1, 1) > before[1] and r.chance(1, 0) < before[0]
    assert r.chance(2, 0) == pytest.approx(r.rates[(2, 0)][0] / r.rates[(2, 0)][1])


def test_the_table_holds_the_targets_top_k_after_every_forward(engine_for, llama, always_draft):
    eng = engine_for("recycle", llama)
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=8))
    table = eng.proposer.shared
    text = DISTINCT + r.token_ids
    with torch.inference_mode():
        logits = llama(torch.tensor([text])).logits[0]
    last = text[-2]                        # the last token run through the target (the final one was not)
    assert table[last] == logits[len(text) - 2].topk(8).indices.tolist()


@pytest.mark.parametrize("options", [{}, dict(candidates=1), dict(tree_size=1), dict(tree_size=64, candidates=16)])
def test_greedy_equals_hf_greedy_alone_and_batched(engine_for, reference, llama, always_draft, options):
    prompts = [DISTINCT, REPEATS, [1], [2, 3], list(range(2, 40, 3))]
    eng = engine_for("recycle", llama, **options)
    results = eng.generate(prompts, SamplingConfig(max_new_tokens=N, n=2))
    for r in results:
        assert r.token_ids == reference(llama, prompts[r.prompt_index], N), (r.prompt_index, r.sample_index)
    assert sum(sum(r.stats.position_offered) for r in results) > 0, "nothing was drafted"
    [again] = eng.generate([REPEATS], SamplingConfig(max_new_tokens=N))
    assert again.token_ids == reference(llama, REPEATS, N)
    assert again.stats.tau > 1.5, "the table kept from the earlier generations drafts this text"


def test_as_a_source_of_rest_and_what_forget_drops(engine_for, reference, llama, always_draft):
    prompts = [DISTINCT, REPEATS, [2, 3]]
    eng = engine_for("rest", llama, datastore="none", recycle=4)
    assert eng.proposer.needs_logits
    assert not engine_for("rest", llama, datastore="none", recycle=0).proposer.needs_logits
    assert engine_for("rest", llama, datastore="none").proposer.options.recycle == 8, "on by default"
    for _ in range(2):
        results = eng.generate(prompts, SamplingConfig(max_new_tokens=N))
        assert [r.token_ids for r in results] == [reference(llama, p, N) for p in prompts]
    assert eng.proposer.table, "the forwards filled the table"
    eng.proposer.forget()
    assert not eng.proposer.table
    assert all(row.recycler.table is eng.proposer.table for row in eng.proposer.rows), "greedy rows share the new one"
    alone = engine_for("recycle", llama)
    alone.generate(prompts, SamplingConfig(max_new_tokens=N))
    assert alone.proposer.shared
    alone.proposer.forget()
    assert not alone.proposer.shared and all(row.table is alone.proposer.shared for row in alone.proposer.rows)


def test_decoding_up_to_the_context_limit(engine_for, reference, llama, always_draft):
    prompt = (list(range(100, 128)) * 20)[: MAX_POSITIONS - 9]
    [r] = engine_for("recycle", llama).generate([prompt], SamplingConfig(max_new_tokens=50))
    assert len(prompt) + len(r.token_ids) == MAX_POSITIONS and r.finish_reason == "length"
    assert r.token_ids == reference(llama, prompt, 9)


def test_greedy_with_penalties_and_logit_bias_equals_plain(engine_for, llama, always_draft):
    prompts = [DISTINCT, REPEATS, [2, 3]]
    for method, options in (("recycle", {}), ("rest", {"datastore": "none", "recycle": 8})):
        results = engine_for(method, llama, **options).generate(prompts, PENALISED)
        assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in prompts], method


def test_it_backs_off_to_plain_steps_when_drafts_do_not_pay(engine_for, reference, llama, monkeypatch,
                                                          forward_widths):
    from spekit.pacing.step_costs import StepCosts
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 5.0)
    eng = engine_for("recycle", llama)
    monkeypatch.setattr(eng, "_calibrate", lambda kv, ctx: None)
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=40))
    assert r.token_ids == reference(llama, DISTINCT, 40)
    steps = forward_widths[1:]
    assert sum(s == 1 for s in steps) >= 0.9 * len(steps), steps


@pytest.fixture
def full_tables(monkeypatch):
    """Sampled rows start from an empty table of their own; here every token's row of it is filled at once (a
    random order of the whole small vocabulary), so that the first step after the prefill drafts siblings."""
    rng = np.random.default_rng(5)
    init = Recycler.__init__

    def filled(self, table, k):
        init(self, table, k)
        for tok in range(V_SMALL):
            table.setdefault(tok, rng.permutation(V_SMALL)[:k].tolist())
    monkeypatch.setattr(Recycler, "__init__", filled)


@pytest.mark.parametrize("config", list(DIST_CONFIGS))
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, full_tables, config):
    """The first two tokens of many samples; the second comes from a step that verified a tree of point masses."""
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=DIST_SAMPLES, seed=11)
    results = engine_for("recycle", small_target, candidates=3).generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results, DIST_SAMPLES // 3)


def test_a_sample_depends_on_its_seed_alone(engine_for, llama):
    """Not on its batch, nor on the table the engine's greedy generations built before."""
    cfg = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=N, n=2, seed=3)
    batch = [DISTINCT, REPEATS, [1]]
    used = engine_for("recycle", llama)
    used.generate(batch, SamplingConfig(max_new_tokens=N))
    assert used.proposer.shared
    together = used.generate(batch, cfg)
    alone = [r for p in batch for r in engine_for("recycle", llama).generate([p], cfg)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("options,match", [(dict(candidates=0), "candidates"), (dict(tree_size=0), "tree_size"),
                                           (dict(num_draft_tokens=0), "num_draft_tokens")])
def test_bad_options_are_user_errors(options, match, llama):
    with pytest.raises(UserError, match=match):
        RecycleOptions(**options)
    with pytest.raises(UserError, match="recycle"):
        RestOptions(recycle=-1)
    with pytest.raises(UserError, match="vocabulary"):
        Recycle(Target(llama), RecycleOptions(candidates=llama.config.vocab_size + 1))
    with pytest.raises(UserError, match="vocabulary"):
        Rest(Target(llama), RestOptions(datastore="none", recycle=llama.config.vocab_size + 1))


def test_registered():
    assert proposers.get("recycle") is Recycle and recycle.PRIOR[0] > recycle.PRIOR[-1]


def test_a_resting_row_ranks_its_tree_every_few_steps_at_greedy_steps_only(engine_for, reference, llama,
                                                                          monkeypatch):
    """A row that has drafted nothing for resting.IDLE steps, where ranking costs more than resting.OVERHEAD of a
    plain step, ranks its tree every `every` steps only (it still judges the table's first guess at every step);
    the output is plain's. A sampled row ranks at every step whatever the clock said."""
    from spekit.pacing.step_costs import StepCosts
    from spekit.proposers import resting
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 100.0)
    monkeypatch.setattr(resting.Resting, "ranked", lambda self, ctx, full: setattr(self, "every", 3))
    ranked, rank = [], Recycler.rank
    monkeypatch.setattr(Recycler, "rank", lambda self, *a: ranked.append(1) or rank(self, *a))
    eng = engine_for("recycle", llama)
    assert eng.generate([REPEATS], SamplingConfig(max_new_tokens=N))[0].token_ids == reference(llama, REPEATS, N)
    steps = N - 1
    assert len(ranked) == resting.IDLE + (steps - resting.IDLE) // 3
    ranked.clear()
    eng.generate([REPEATS], SamplingConfig(temperature=1.0, max_new_tokens=N, seed=2))
    assert len(ranked) == steps


def test_an_idle_rows_table_takes_plain_steps_logits_as_often_as_the_top_k_is_cheap():
    """After IDLE steps that drafted nothing, a sampled row refreshes its table every REFRESH-th step whatever the
    clock says; at greedy steps as often as keeps the measured top-k near TOPK_SHARE of a plain step (every step
    where a plain step is long, every LONGEST-th at most where it is short)."""
    from types import SimpleNamespace
    from spekit.proposers.recycle import IDLE, LONGEST, REFRESH, Refreshing

    def ctx(greedy: bool, plain_s: float):
        return SimpleNamespace(tokens=[[1, 2]], cfg=SimpleNamespace(greedy=greedy),
                               budget=SimpleNamespace(plain_s=plain_s))
    paced, row = Refreshing(REFRESH), Recycler({}, 2)
    flags = [paced.flags([row], greedy=False)[0] for _ in range(24)]
    assert flags == [True] * (IDLE - 1) + [i % REFRESH == 0 for i in range(IDLE, 25)]
    logits = torch.randn(1, 1, 50)
    paced.refresh(ctx(True, 1e-12), [row], [True], logits, None, 2)          # a top-k far dearer than a step
    assert paced.greedy_every == LONGEST and row.table[2] == logits[0, 0].topk(2).indices.tolist()
    paced.refresh(ctx(True, 1e6), [row], [True], logits, None, 2)            # far cheaper
    assert paced.greedy_every == 1 and all(paced.flags([row], greedy=True)[0] for _ in range(8))
    paced.refresh(ctx(False, 1e-12), [row], [True], logits, None, 2)         # sampled: the clock is not read
    assert paced.greedy_every == 1
