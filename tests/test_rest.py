"""Retrieval drafting (`--method rest`): the datastore finds what it should and fails clearly on bad files; the
method reproduces plain greedy output exactly (alone, batched, sliding-window layers, up to the context's end),
its sampled tokens follow the target's law, it backs off where drafts do not pay."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from spekit import proposers
from spekit.config import SamplingConfig, UserError
from spekit.retrieval.datastore import SEP, Datastore, load_datastore, write_datastore
from spekit.retrieval.history import History
from spekit.heads.base import target_info
from spekit.pacing.sizing import best_node_count
from spekit.proposers.rest import Rest, RestOptions
from spekit.backends.torch_target import Target
from test_engine import DIST_CONFIGS, DIST_PROMPT, DIST_SAMPLES, V_SMALL, both_ways, first_two_exact
from conftest import PENALISED, penalised_greedy

DISTINCT = [5, 17, 42, 9, 3, 88, 61, 120, 33]
REPEATS = [7, 8, 9, 10] * 5
SHORT = [1]
N = 32
MAX_POSITIONS = 512


def store_dir(tmp_path, model, sequences: list[list[int]], name: str = "store") -> str:
    return str(write_datastore(tmp_path / name, sequences, target_info(Target(model)), {"command": "test"}))


@pytest.fixture
def own_store(tmp_path, llama, reference):
    """A datastore of the tiny model's own greedy answers to other prompts, and some noise."""
    rng = np.random.default_rng(0)
    seqs = [reference(llama, p, 48) for p in ([2, 3], [40, 41, 42], [100, 7])]
    seqs += [rng.integers(0, 128, 60).tolist() for _ in range(4)]
    return store_dir(tmp_path, llama, seqs)


def test_lookup_takes_the_longest_match_and_stops_at_a_sequence_end():
    store = Datastore.from_sequences([[1, 2, 3, 4, 5], [9, 2, 3, 7], [8, 3, 6]], ngram_min=1, ngram_max=3)
    assert store.lookup([0, 1, 2, 3], depth=4, most=8) == (3, [[4, 5]])           # 1 2 3 -> 4 5 (then the end)
    n, conts = store.lookup([5, 2, 3], depth=4, most=8)
    assert n == 2 and sorted(conts) == [[4, 5], [7]]
    n, conts = store.lookup([3], depth=1, most=8)
    assert n == 1 and sorted(conts) == [[4], [6], [7]]
    assert store.lookup([42], depth=4, most=8) == (0, [])
    assert len(store.lookup([3], depth=2, most=2)[1]) == 2                         # at most `most`
    assert len(store) == 12


def test_a_hash_collision_drafts_nothing(monkeypatch):
    import spekit.retrieval.datastore as ds
    monkeypatch.setattr(ds, "_MULT", np.int64(0))      # every n-gram hashes to its last token
    store = ds.Datastore.from_sequences([[1, 2, 3, 4]], ngram_min=2, ngram_max=2)
    assert store.lookup([9, 3], depth=2, most=4) == (0, [])
    assert store.lookup([2, 3], depth=2, most=4) == (2, [[4]])


def test_datastore_files_round_trip_and_bad_files_are_user_errors(tmp_path, llama):
    where = store_dir(tmp_path, llama, [[1, 2, 3], [4, 5]])
    store = load_datastore(where, 128)
    assert store.tokens.tolist() == [1, 2, 3, SEP, 4, 5, SEP]
    assert json.loads((tmp_path / "store" / "config.json").read_text())["meta"]["sequences"] == 2
    with pytest.raises(UserError, match="another model"):
        load_datastore(where, 256)
    with pytest.raises(UserError, match="no config.json"):
        load_datastore(tmp_path, 128)
    (tmp_path / "store" / "model.safetensors").write_bytes(b"\x00" * 9)
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_datastore(where, 128)
    big = store_dir(tmp_path, llama, [[1, 500]], name="big")
    with pytest.raises(UserError, match="outside this model's vocabulary"):
        load_datastore(big, 128)


def test_without_a_datastore_for_the_model_it_drafts_from_the_context_and_the_history(engine_for, reference, llama,
                                                                                      always_draft):
    """Any model can run rest: where no datastore ships for it (nor is given), the sources are the context and,
    at greedy steps, the engine's earlier texts."""
    target = Target(llama)
    assert Rest(target, RestOptions()).store is None and Rest(target, RestOptions(datastore="none")).store is None
    eng = engine_for("rest", llama)
    first, again = (eng.generate([DISTINCT], SamplingConfig(max_new_tokens=N))[0] for _ in range(2))
    assert first.token_ids == again.token_ids == reference(llama, DISTINCT, N)
    assert again.stats.tau > first.stats.tau


@pytest.mark.parametrize("options,match", [(dict(tree_size=0), "tree_size"), (dict(num_draft_tokens=0), "num_draft"),
                                           (dict(retrieve_min=3, retrieve_max=2), "retrieve_min"),
                                           (dict(ngram_min=0), "ngram_min"), (dict(history_tokens=-1), "history")])
def test_bad_options_are_user_errors(options, match):
    with pytest.raises(UserError, match=match):
        RestOptions(**options)


def test_several_continuations_become_siblings(llama):
    """The context holds `3 4` followed by 5 and by 6: both are drafted, the most recent first."""
    rest = Rest(Target(llama), RestOptions(datastore="none"))
    from spekit.pacing import Budget
    from spekit.proposers.base import StepContext
    tokens = [1, 3, 4, 5, 9, 3, 4, 6, 2, 3, 4]
    ctx = StepContext([tokens], torch.tensor([4]), torch.tensor([10]),
                      cfg=SamplingConfig(), gens=None, target=Target(llama), budget=Budget(room=[8], cost=lambda n: 1.0))
    rest.begin(ctx)
    tree = rest.propose(ctx)
    firsts = {int(tree.tokens[0, c]) for c in tree.children[0, 0].tolist() if c >= 0}
    assert firsts == {5, 6}


def test_node_count_backs_off_when_the_forward_is_dear():
    ranked = [[((1,), 0.9, {}), ((1, 2), 0.8, {}), ((1, 2, 3), 0.5, {})]]
    assert best_node_count(ranked, lambda n: 1.0) == 3
    assert best_node_count(ranked, lambda n: 1.0 if n <= 3 else 2.0) == 2
    assert best_node_count(ranked, lambda n: 1.0 if n == 1 else 5.0) == 0


@pytest.mark.parametrize("options", [{}, dict(tree_size=1), dict(tree_size=64, retrieve_min=1, num_draft_tokens=16)])
def test_greedy_equals_hf_greedy_alone_and_batched(engine_for, reference, llama, always_draft, own_store, options):
    prompts = [DISTINCT, REPEATS, SHORT, [2, 3], list(range(2, 40, 3))]
    eng = engine_for("rest", llama, datastore=own_store, **options)
    results = eng.generate(prompts, SamplingConfig(max_new_tokens=N, n=2))
    for r in results:
        assert r.token_ids == reference(llama, prompts[r.prompt_index], N), (r.prompt_index, r.sample_index)
    # the datastore's part alone (a recycled guess may take a one-node tree's place before the rates learn)
    [alone] = engine_for("rest", llama, datastore=own_store, **options, recycle=0).generate(
        [[2, 3]], SamplingConfig(max_new_tokens=N))
    assert alone.token_ids == reference(llama, [2, 3], N)
    assert alone.stats.tau > (1.8 if options.get("tree_size") == 1 else 2.5), "the datastore holds this answer"


def test_greedy_with_sliding_window_layers_equals_hf(engine_for, reference, gemma_sliding, always_draft, tmp_path):
    prompts = [[3, 4, 5, 6, 7], [9, 10, 11] * 4, SHORT]
    where = store_dir(tmp_path, gemma_sliding, [reference(gemma_sliding, p, 48) for p in prompts[:2]])
    results = engine_for("rest", gemma_sliding, datastore=where).generate(prompts, SamplingConfig(max_new_tokens=40))
    for r in results:
        assert r.token_ids == reference(gemma_sliding, prompts[r.prompt_index], 40), r.prompt_index


def test_decoding_up_to_the_context_limit(engine_for, reference, llama, always_draft, own_store):
    prompt = (list(range(100, 128)) * 20)[: MAX_POSITIONS - 9]
    [r] = engine_for("rest", llama, datastore=own_store).generate([prompt], SamplingConfig(max_new_tokens=50))
    assert len(prompt) + len(r.token_ids) == MAX_POSITIONS and r.finish_reason == "length"
    assert r.token_ids == reference(llama, prompt, 9)


def test_it_backs_off_to_plain_steps_when_drafts_do_not_pay(engine_for, reference, llama, monkeypatch, own_store,
                                                          forward_widths):
    from spekit.pacing.step_costs import StepCosts
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 5.0)
    eng = engine_for("rest", llama, datastore=own_store)
    monkeypatch.setattr(eng, "_calibrate", lambda kv, ctx: None)
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=40))     # its answer is not in the datastore
    assert r.token_ids == reference(llama, DISTINCT, 40)
    steps = forward_widths[1:]
    # plain steps, until the shadow drafts (first nodes judged without drafting) show the answer has begun to loop:
    # from there the context's continuations are right, and its few wide steps each gain several tokens
    assert sum(s == 1 for s in steps) >= 0.8 * len(steps), str(steps)
    drafted = [n for n, w in zip(r.stats.accept_lengths[-len(steps):], steps) if w > 1]
    assert sum(drafted) >= 3 * len(drafted), str(drafted)


@pytest.mark.parametrize("config", list(DIST_CONFIGS))
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, tmp_path, config):
    """The first two tokens of many samples; the datastore holds several continuations of every token, so a step
    verifies siblings (point masses tried in turn by the recursive rejection rule)."""
    rng = np.random.default_rng(1)
    where = store_dir(tmp_path, small_target, [rng.integers(0, V_SMALL, 40).tolist() for _ in range(6)])
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=DIST_SAMPLES, seed=11)
    results = engine_for("rest", small_target, datastore=where, retrieve_min=1).generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results, DIST_SAMPLES // 3)


def test_seeded_sampling_repeats_and_rows_do_not_depend_on_their_batch(engine_for, llama, own_store):
    cfg = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=N, n=2, seed=3)
    batch = [DISTINCT, REPEATS, SHORT]
    together = engine_for("rest", llama, datastore=own_store).generate(batch, cfg)
    alone = [r for p in batch for r in engine_for("rest", llama, datastore=own_store).generate([p], cfg)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


# --- the history: texts this engine finished, drafted from at greedy steps ------------------------------------------

def test_history_finds_the_latest_continuations_and_forgets_the_oldest_texts():
    h = History(capacity=12, ngram_min=2, ngram_max=3)
    h.add([1, 2, 3, 4])
    h.add([9, 2, 3, 7, 8])
    assert h.lookup([5, 2, 3], depth=4, most=8) == (2, [[7, 8], [4]])      # latest first, each to its text's end
    assert h.lookup([9, 2, 3], depth=1, most=8) == (3, [[7]])               # the longest n-gram wins
    assert h.lookup([2, 3], depth=4, most=1) == (2, [[7, 8]])
    h.add([6, 6, 2, 3, 5])                                                  # 14 tokens > 12: the first text goes
    assert len(h) == 10 and h.lookup([2, 3], depth=4, most=8) == (2, [[5], [7, 8]])
    assert h.lookup([1, 2], depth=4, most=8) == (0, [])
    rng = np.random.default_rng(1)                         # after many texts came and went, the index is
    added = []
    for _ in range(60):                                    # the one those kept would build afresh
        added.append(rng.integers(0, 6, int(rng.integers(2, 9))).tolist())
        h.add(added[-1])
    assert h.waiting                                       # texts wait unindexed until a lookup asks
    keep = max(k for k in range(len(added) + 1) if sum(map(len, added[len(added) - k:])) <= 12)
    assert list(h.texts) == added[len(added) - keep:]      # the newest that fit, as if each were indexed at once
    fresh = History(capacity=1000, ngram_min=2, ngram_max=3)
    for text in h.texts:
        fresh.add(text)
    assert len(h) == len(fresh) <= 12
    for context in ([a, b, c] for a in range(6) for b in range(6) for c in range(6)):
        assert h.lookup(context, depth=5, most=3) == fresh.lookup(context, depth=5, most=3)
    h.clear()
    assert len(h) == 0 and h.lookup([2, 3], depth=4, most=8) == (0, [])
    off = History(capacity=0)
    off.add([1, 2, 3])
    assert len(off) == 0


def test_a_prompt_asked_again_is_drafted_from_the_last_answer_and_output_stays_plain(engine_for, reference, llama,
                                                                                 always_draft):
    """Greedy: the second time a prompt is asked, its whole answer is in the history (a text finished by this
    engine, batched or alone), so nearly every step accepts a long draft; the output is still plain's."""
    prompts = [DISTINCT, [2, 3]]
    eng = engine_for("rest", llama, datastore="none", tree_size=4, recycle=0)    # the history's part alone
    first = eng.generate(prompts, SamplingConfig(max_new_tokens=N))
    again = eng.generate(prompts, SamplingConfig(max_new_tokens=N))
    for r in first + again:
        assert r.token_ids == reference(llama, prompts[r.prompt_index], N)
    assert all(b.stats.tau > a.stats.tau for a, b in zip(first, again))
    assert min(r.stats.tau for r in again) > 3          # of at most 5 (4-node chains)
    eng.proposer.forget()
    assert [r.stats.tau for r in eng.generate(prompts, SamplingConfig(max_new_tokens=N))] == \
        [r.stats.tau for r in first]
    off = engine_for("rest", llama, datastore="none", tree_size=4, history_tokens=0, recycle=0)
    off.generate(prompts, SamplingConfig(max_new_tokens=N))
    assert [r.stats.tau for r in off.generate(prompts, SamplingConfig(max_new_tokens=N))] == \
        [r.stats.tau for r in first]


def test_sampling_never_drafts_from_the_history(engine_for, llama, own_store):
    """A sample depends on its seed and its own text, not on what the engine wrote before."""
    cfg = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=N, seed=3)
    used = engine_for("rest", llama, datastore=own_store)
    used.generate([DISTINCT, REPEATS], SamplingConfig(max_new_tokens=N))       # greedy texts go into its history
    used.generate([DISTINCT], cfg)
    fresh = engine_for("rest", llama, datastore=own_store)
    assert len(used.proposer.history) > 0
    assert [r.token_ids for r in used.generate([DISTINCT, REPEATS], cfg)] == \
        [r.token_ids for r in fresh.generate([DISTINCT, REPEATS], cfg)]


def test_registered_with_its_options():
    assert proposers.get("rest") is Rest


@pytest.mark.slow
def test_bundled_model_with_the_shipped_datastore_equals_plain_greedy(always_draft):
    from spekit.api import Spekit
    sk = Spekit.load("smollm2-135m")
    ids = [sk.encode("Summarize: the council approved the park budget; the park opens next spring."),
           sk.encode("Write a Python function that returns the squares of a list.")]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = sk.engine.generate(ids, cfg)
    rest = sk.with_method("rest").engine.generate(ids, cfg)
    assert [r.token_ids for r in rest] == [r.token_ids for r in plain]
    assert rest[0].stats.target_forwards < 24


def test_greedy_with_penalties_and_logit_bias_equals_plain(engine_for, llama, always_draft, own_store):
    prompts = [DISTINCT, REPEATS, [2, 3]]
    results = engine_for("rest", llama, datastore=own_store).generate(prompts, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in prompts]


def test_a_held_batch_takes_plain_steps_and_indexes_nothing(engine_for, reference, llama, always_draft, monkeypatch):
    """Where the engine's governor holds drafting back, every step is a plain one (no tree: None, no ranking),
    the rows' context is not indexed and the finished texts wait unindexed in the history: a held batch pays
    nothing for rest's sources. The output is plain's, and the history still serves a later row that may draft."""
    from spekit.pacing.governor import Governor
    monkeypatch.setattr(Governor, "allows", lambda self: False)
    eng = engine_for("rest", llama, datastore="none")
    sizes = []
    propose = eng.proposer.propose
    monkeypatch.setattr(eng.proposer, "propose", lambda ctx: sizes.append(propose(ctx)) or eng.proposer.tree)
    prompts = [DISTINCT, [2, 3, 4]]
    out = eng.generate(prompts, SamplingConfig(max_new_tokens=N))
    assert [r.token_ids for r in out] == [reference(llama, p, N) for p in prompts]
    assert sizes and set(sizes) == {None} and all(r.stats.tau == 1.0 for r in out)
    assert all(row.fed == 0 and not row.seen for row in eng.proposer.rows)
    eng.proposer._retire(eng.proposer.rows)                                    # as the next generation would
    assert eng.proposer.history.waiting and not eng.proposer.history.seen
    assert len(eng.proposer.history) > 0 and eng.proposer.history.seen      # indexed once asked for


def test_a_resting_row_consults_its_dear_sources_every_few_steps_at_greedy_steps_only(engine_for, reference, llama,
                                                                                      own_store, monkeypatch):
    """Where a row has drafted nothing for resting.IDLE rankings and its ranking costs more than resting.OVERHEAD of
    a plain step (a CPU backend's short steps), the datastore (and the history, the recycled table) is consulted only every
    `every` steps, the context every step; the output stays plain's. A sampled row consults every source at
    every step whatever the clock said, so that its seed alone fixes its drafts."""
    from spekit.pacing.step_costs import StepCosts
    from spekit.proposers import resting
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 100.0)
    monkeypatch.setattr(resting.Resting, "ranked", lambda self, ctx, full: setattr(self, "every", 3))
    lookups, ranked = [], []
    lookup, rank = Datastore.lookup, Rest._rank
    monkeypatch.setattr(Datastore, "lookup", lambda self, *a: lookups.append(1) or lookup(self, *a))
    monkeypatch.setattr(Rest, "_rank", lambda self, *a: ranked.append(1) or rank(self, *a))
    eng = engine_for("rest", llama, datastore=own_store)
    out = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=N))[0].token_ids
    assert out == reference(llama, DISTINCT, N)
    idle = resting.IDLE
    assert len(ranked) == N - 1 and len(lookups) == idle + (len(ranked) - idle) // 3   # resting: 1 in 3
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=N, seed=5)
    lookups.clear(), ranked.clear()
    first = eng.generate([DISTINCT], sampled)[0].token_ids
    assert len(lookups) == len(ranked) == N - 1
    assert first == engine_for("rest", llama, datastore=own_store).generate([DISTINCT], sampled)[0].token_ids
