"""The guarantees, end to end through the engine:

- every lossless method reproduces transformers' plain greedy decoding exactly (any draft, any prompt, batched or
  alone, with sliding-window layers, at the end of the context);
- under sampling the first generated tokens follow the target's distribution (not the draft's);
- seeded runs repeat, and a row's output does not depend on its place in the batch;
- limits and stops are respected, statistics add up, and bad input gets a clear UserError.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from spekit import proposers
from spekit.config import SamplingConfig, UserError
from spekit.cache import Window
from spekit.pacing.step_costs import StepCosts
from spekit.engine import Engine
from spekit.sampling import seen_of, target_probs
from spekit.backends.torch_target import Target
from spekit.tree import from_paths
from spekit.backends.draft_vocab import reduce_head

from conftest import PENALISED, penalised_greedy

DISTINCT = [5, 17, 42, 9, 3, 88, 61, 120, 33]           # no token repeats: n-grams never match in the prompt
REPEATS = [7, 8, 9, 10] * 5                             # n-grams match everywhere
SHORT = [1]
PROMPTS = {"distinct": DISTINCT, "repeats": REPEATS, "short": SHORT}
N = 24
MAX_POSITIONS = 512                                      # the tiny models' max_position_embeddings

# method name -> (proposer, which draft, options)
METHODS = {
    "plain": ("plain", None, {}),
    "ngram": ("ngram", None, {}),
    "draft_random": ("draft", "random", {}),
    "draft_perfect": ("draft", "perfect", {"confidence": 0.0}),
}


def engine(engine_for, method: str, model, random_draft=None, stop_ids=()) -> Engine:
    name, which, options = METHODS[method]
    draft = {"random": random_draft, "perfect": model, None: None}[which]
    return engine_for(name, model, draft, stop_ids=stop_ids, **options)


@pytest.fixture
def fixed_verify_cost(monkeypatch):
    """Make the engine's measured cost of a multi-token forward a constant (the ngram proposer's drafting decisions
    depend on it; under sampling the engine must not use the measurement at all, so output cannot depend on it)."""
    def fix(cost: float) -> None:
        monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else cost)
    return fix


# --- lossless: greedy output equals transformers' greedy output -------------------------------------------------

@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_reproduces_hf_greedy(engine_for, reference, llama, llama_draft, method, prompt):
    ids = PROMPTS[prompt]
    [result] = engine(engine_for, method, llama, llama_draft).generate([ids], SamplingConfig(max_new_tokens=N))
    assert result.token_ids == reference(llama, ids, N)
    assert result.finish_reason == "length"


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_repetition_penalty_reproduces_hf(engine_for, reference, llama, llama_draft, method):
    prompts = [DISTINCT, REPEATS]
    cfg = SamplingConfig(max_new_tokens=N, repetition_penalty=1.5)
    for r in engine(engine_for, method, llama, llama_draft).generate(prompts, cfg):
        assert r.token_ids == reference(llama, r.prompt_ids, N, repetition_penalty=1.5)
    assert reference(llama, REPEATS, N, repetition_penalty=1.5) != reference(llama, REPEATS, N), "penalty matters"


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_openai_penalties_and_logit_bias_is_exact(engine_for, llama, llama_draft, method):
    """Frequency and presence penalties count the tokens along each draft path (a tree node's own context), so a
    speculative method gives the tokens plain greedy decoding gives under them."""
    prompts = [DISTINCT, REPEATS]
    results = engine(engine_for, method, llama, llama_draft).generate(prompts, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in prompts]
    assert all(9 not in r.token_ids for r in results), "a -100 bias bans the token"
    unpenalised = dataclasses.replace(PENALISED, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=())
    assert penalised_greedy(llama, REPEATS, unpenalised) != penalised_greedy(llama, REPEATS), "the penalties matter"


@torch.inference_mode()
def min_tokens_greedy(model, ids: list[int], stop: int, least: int, n: int) -> list[int]:
    """Greedy decoding written out: the stop token's logit is -inf while fewer than `least` tokens were generated;
    the answer ends after the first stop token, or at n tokens."""
    out: list[int] = []
    while len(out) < n and (not out or out[-1] != stop):
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        if len(out) < least:
            logits[stop] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("via", ["config", "engine"])
@pytest.mark.parametrize("method", list(METHODS))
def test_min_new_tokens_holds_the_stop_tokens_back_exactly(engine_for, reference, llama, llama_draft, method, via):
    """min_new_tokens bans the stop tokens (the engine's and the settings') at every draft node whose token would
    come too early, by the node's own depth: each method gives what greedy decoding under the ban gives."""
    full = reference(llama, REPEATS, N)
    stop = full[2]                                                     # ends the answer at its third token
    cfg = SamplingConfig(max_new_tokens=N, min_new_tokens=12, stop_ids=(stop,) if via == "config" else ())
    eng = engine(engine_for, method, llama, llama_draft, stop_ids=(stop,) if via == "engine" else ())
    [held] = eng.generate([REPEATS], cfg)
    [free] = eng.generate([REPEATS], dataclasses.replace(cfg, min_new_tokens=0))
    assert held.token_ids == min_tokens_greedy(llama, REPEATS, stop, 12, N)
    assert stop not in held.token_ids[:12] and len(held.token_ids) > 12
    assert free.token_ids == full[:full.index(stop) + 1] and free.finish_reason == "stop"


@pytest.mark.parametrize("method", ["recycle", "lookahead", "rest"])
def test_min_new_tokens_on_draft_trees(engine_for, reference, llama, method):
    """Tree nodes are banned by their own depth: siblings at one depth alike, deeper nodes of a path not."""
    stop = reference(llama, REPEATS, N)[2]
    cfg = SamplingConfig(max_new_tokens=N, min_new_tokens=12, stop_ids=(stop,))
    [held] = engine_for(method, llama).generate([REPEATS], cfg)
    assert held.token_ids == min_tokens_greedy(llama, REPEATS, stop, 12, N)


def test_min_new_tokens_must_fit_max_new_tokens():
    with pytest.raises(UserError, match=r"min_new_tokens must be in \[0, max_new_tokens = 8\]"):
        SamplingConfig(max_new_tokens=8, min_new_tokens=9)


def test_until_ends_a_row_where_the_caller_says(engine_for, reference, llama):
    """Engine.generate's `until` (how text stop sequences reach the token core): told each commit's new tokens, a
    True ends that row there with finish "stop"; the other rows run on unchanged."""
    told: dict[int, list[int]] = {}

    def until(row: int, tokens: list[int]) -> bool:
        told.setdefault(row, []).extend(tokens)
        return row == 0 and len(told[0]) >= 5
    first, second = engine(engine_for, "ngram", llama).generate([REPEATS, DISTINCT], SamplingConfig(max_new_tokens=N),
                                                                until)
    assert first.finish_reason == "stop" and 5 <= len(first.token_ids) < N
    assert first.token_ids == reference(llama, REPEATS, N)[: len(first.token_ids)] == told[0]
    assert second.token_ids == reference(llama, DISTINCT, N) and second.finish_reason == "length"


@pytest.mark.parametrize("method", list(METHODS))
def test_batch_rows_equal_hf_greedy_alone(engine_for, reference, llama, llama_draft, method):
    """Prompts of different lengths, two samples each, decoded together: each row is what its prompt alone gives."""
    prompts = [DISTINCT, REPEATS, SHORT, list(range(2, 40, 3))]
    results = engine(engine_for, method, llama, llama_draft).generate(prompts, SamplingConfig(max_new_tokens=N, n=2))
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, s) for i in range(4) for s in range(2)]
    for r in results:
        assert r.prompt_ids == prompts[r.prompt_index]
        assert r.token_ids == reference(llama, prompts[r.prompt_index], N), (r.prompt_index, r.sample_index)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_perfect", "draft_random"])
def test_sliding_window_model_reproduces_hf_greedy(engine_for, reference, gemma_sliding, gemma_draft, method):
    """Gemma 3 with window-8 sliding layers, decoded far past the window, batched with ragged prompts."""
    prompts = [[3, 4, 5, 6, 7], [9, 10, 11] * 4, SHORT]
    n = 40
    results = engine(engine_for, method, gemma_sliding, gemma_draft).generate(
        prompts, SamplingConfig(max_new_tokens=n))
    for r in results:
        assert r.token_ids == reference(gemma_sliding, prompts[r.prompt_index], n), r.prompt_index


def test_the_window_matters_in_the_sliding_window_test(reference, gemma_sliding, gemma_wide):
    """Guards the test above: with the same weights and a window longer than the text, greedy output differs."""
    assert gemma_sliding.config.sliding_window == 8
    assert "sliding_attention" in gemma_sliding.config.layer_types
    assert "full_attention" in gemma_sliding.config.layer_types
    assert Target(gemma_sliding).sliding_window == Window(8)          # on the sliding layers only
    ids = [3, 4, 5, 6, 7]
    assert reference(gemma_sliding, ids, 40) != reference(gemma_wide, ids, 40)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_perfect"])
def test_decoding_up_to_the_context_limit(engine_for, reference, llama, llama_draft, method):
    """Near max_position_embeddings a row stops with "length" once the context is full; drafts are cut to fit."""
    prompt = (list(range(100, 128)) * 20)[: MAX_POSITIONS - 9]
    [r] = engine(engine_for, method, llama, llama_draft).generate([prompt], SamplingConfig(max_new_tokens=50))
    assert len(prompt) + len(r.token_ids) == MAX_POSITIONS
    assert r.finish_reason == "length"
    assert r.token_ids == reference(llama, prompt, 9)


# --- speed: the statistics add up ---------------------------------------------------------------------------------

def assert_stats_consistent(r) -> None:
    s = r.stats
    assert s.new_tokens == len(r.token_ids)
    assert s.target_forwards >= 1
    assert s.tau == pytest.approx(s.new_tokens / s.target_forwards)
    assert sum(s.accept_hist.values()) == s.target_forwards
    assert len(s.accept_lengths) == s.target_forwards
    assert sum(k * v for k, v in s.accept_hist.items()) == sum(s.accept_lengths) >= s.new_tokens
    assert all(0 <= a <= o for a, o in zip(s.position_accepted, s.position_offered))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", list(METHODS))
def test_statistics_are_consistent(engine_for, llama, llama_draft, method, temperature):
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=N, n=2, seed=5)
    for r in engine(engine_for, method, llama, llama_draft).generate([DISTINCT, REPEATS], cfg):
        assert_stats_consistent(r)
        if method == "plain":
            assert r.stats.tau == 1.0 and r.stats.accept_hist == {1: N}


def test_a_reduced_vocabulary_draft_reproduces_hf_greedy(engine_for, reference, llama, always_draft):
    """A copy of the target whose LM head covers half the vocabulary (spekit.backends.draft_vocab): it drafts the target's own
    tokens where they are in its half and is rejected elsewhere; the output stays the target's. (Verification at
    a fixed cost: by the clock of a busy machine the pacer at times stopped drafting, 1 run in 10.)"""
    draft = copy.deepcopy(llama)
    reduce_head(draft, list(range(0, llama.config.vocab_size, 2)))
    eng = engine_for("draft", llama, draft, confidence=0.0)
    for prompt in (DISTINCT, REPEATS):
        [r] = eng.generate([prompt], SamplingConfig(max_new_tokens=N))
        assert r.token_ids == reference(llama, prompt, N)
        accepted = sum(r.stats.position_accepted)
        assert 0 < accepted < sum(r.stats.position_offered), "both acceptances and rejections happen"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_perfect_draft_gains_several_tokens_per_forward(engine_for, llama, llama_draft, always_draft, temperature):
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=1)
    [r] = engine(engine_for, "draft_perfect", llama, llama_draft).generate([DISTINCT], cfg)
    assert r.stats.tau > 3
    assert r.stats.position_acceptance()[0] == 1.0


def test_ngram_drafts_where_the_text_repeats(engine_for, llama, always_draft):
    """(At a flat cost: the governor rightly backs off on a tiny model whose measured multi-token forward, on a busy
    machine, can cost more than the drafts gain; CI once saw no draft at all.)"""
    [r] = engine(engine_for, "ngram", llama).generate([REPEATS], SamplingConfig(max_new_tokens=N))
    assert sum(r.stats.position_offered) > 0
    assert r.stats.tau > 1


# --- limits and stops ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_new", [2, 7])
@pytest.mark.parametrize("method", list(METHODS))
def test_max_new_tokens_is_respected(engine_for, reference, llama, llama_draft, method, max_new):
    results = engine(engine_for, method, llama, llama_draft).generate(
        [DISTINCT, REPEATS], SamplingConfig(max_new_tokens=max_new))
    assert len(results) == 2
    for r in results:
        assert len(r.token_ids) == max_new and r.finish_reason == "length"
        assert r.token_ids == reference(llama, r.prompt_ids, N)[:max_new]




@pytest.mark.parametrize("case", ["max_new_tokens=1", "stop_on_first", "context_full"])
def test_a_row_finished_by_its_first_token(engine_for, reference, llama, case):
    """A row whose first generated token already ends it is returned once, with that one token."""
    prompt = [3] * (MAX_POSITIONS - 1) if case == "context_full" else DISTINCT
    first = reference(llama, prompt, 1)[0]
    cfg = SamplingConfig(max_new_tokens=1 if case == "max_new_tokens=1" else N,
                         stop_ids=(first,) if case == "stop_on_first" else ())
    results = engine_for("plain", llama).generate([prompt, SHORT], cfg)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (1, 0)]
    assert results[0].token_ids == [first]
    assert results[0].finish_reason == ("stop" if case == "stop_on_first" else "length")


@pytest.mark.parametrize("via", ["config", "engine"])
@pytest.mark.parametrize("method", list(METHODS))
def test_a_stop_id_ends_the_row(engine_for, reference, llama, llama_draft, method, via):
    """The row ends right after the first stop token (even inside an accepted draft); other rows go on."""
    full = reference(llama, DISTINCT, N)
    stop = full[5]
    cut = full.index(stop) + 1
    other = next(p for p in (REPEATS, SHORT, [4, 4, 4]) if stop not in reference(llama, p, N))
    cfg = SamplingConfig(max_new_tokens=N, stop_ids=(stop,) if via == "config" else ())
    eng = engine(engine_for, method, llama, llama_draft, stop_ids=(stop,) if via == "engine" else ())
    stopped, running = eng.generate([DISTINCT, other], cfg)
    assert stopped.token_ids == full[:cut] and stopped.finish_reason == "stop"
    assert running.token_ids == reference(llama, other, N) and running.finish_reason == "length"
    assert_stats_consistent(stopped)


@pytest.mark.parametrize("method", ["plain", "draft_perfect"])
def test_stream_yields_what_generate_returns(engine_for, llama, llama_draft, method):
    cfg = SamplingConfig(max_new_tokens=N, n=2)
    prompts = [DISTINCT, SHORT]
    eng = engine(engine_for, method, llama, llama_draft)
    events = list(eng.stream(prompts, cfg))
    results = eng.generate(prompts, cfg)
    for row, r in enumerate(results):
        mine = [e for e in events if e.row == row]
        assert [t for e in mine for t in e.tokens] == r.token_ids
        assert all(e.finish is None and e.result is None for e in mine[:-1])
        assert mine[-1].finish == "length" and mine[-1].result.token_ids == r.token_ids


# --- sampling: seeded runs repeat; a row does not depend on its batch -------------------------------------------

SAMPLED = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=N, n=2, seed=3)
BATCH = [DISTINCT, REPEATS, SHORT, list(range(2, 40, 3))]


@pytest.mark.parametrize("method", ["plain", "draft_random", "draft_perfect"])
def test_same_seed_same_output(engine_for, llama, llama_draft, method):
    first = engine(engine_for, method, llama, llama_draft).generate(BATCH, SAMPLED)
    again = engine(engine_for, method, llama, llama_draft).generate(BATCH, SAMPLED)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    other = engine(engine_for, method, llama, llama_draft).generate(BATCH, SamplingConfig(
        temperature=1.0, top_k=50, max_new_tokens=N, n=2, seed=4))
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    assert first[0].token_ids != first[1].token_ids, "samples of one prompt differ"


def test_same_seed_same_output_ngram_at_a_fixed_cost(engine_for, llama, fixed_verify_cost):
    fixed_verify_cost(1.3)
    first = engine(engine_for, "ngram", llama).generate(BATCH, SAMPLED)
    again = engine(engine_for, "ngram", llama).generate(BATCH, SAMPLED)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]


def test_ngram_sampled_output_does_not_depend_on_measured_timing(engine_for, llama, fixed_verify_cost):
    fixed_verify_cost(1.3)
    slow_drafts = engine(engine_for, "ngram", llama).generate(BATCH, SAMPLED)
    fixed_verify_cost(4.0)
    no_drafts = engine(engine_for, "ngram", llama).generate(BATCH, SAMPLED)
    assert [r.token_ids for r in slow_drafts] == [r.token_ids for r in no_drafts]


@pytest.mark.parametrize("method", [
    "plain", "draft_perfect",
    "draft_random",
    "ngram",
])
def test_batch_rows_equal_single_runs_under_sampling(engine_for, llama, llama_draft, fixed_verify_cost, method):
    """A row's seed depends on the seed, its sample index and its prompt, not on its place in the batch."""
    fixed_verify_cost(1.3)
    batch = engine(engine_for, method, llama, llama_draft).generate(BATCH, SAMPLED)
    alone = [r for p in BATCH for r in engine(engine_for, method, llama, llama_draft).generate([p], SAMPLED)]
    mismatched = [(r.prompt_index, r.sample_index) for r, a in zip(batch, alone) if r.token_ids != a.token_ids]
    assert not mismatched
    reordered = engine(engine_for, method, llama, llama_draft).generate(BATCH[::-1], SAMPLED)
    assert [r.token_ids for r in reordered] == [r.token_ids for p in BATCH[::-1] for r in batch
                                                if r.prompt_ids == p]


# --- sampling: the output follows the target distribution -----------------------------------------------------

V_SMALL = 8                                 # small_target's vocabulary
DIST_PROMPT = [3, 1, 4, 1, 5, 2, 6, 7, 0, 2]   # every token recurs: the ngram method drafts after any first one
DIST_SAMPLES = 6000


@torch.inference_mode()
def first_two_exact(model, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """Exact distribution of the first two generated tokens under cfg: [V, V], from the model's logits."""
    vocab = model.config.vocab_size
    rows = [prompt + [a] for a in range(vocab)]
    logits = model(torch.tensor(rows)).logits                                 # [V, P+1, V]
    seen0 = seen_of([prompt], [len(prompt)], cfg, vocab, logits.device)
    seen1 = seen_of(rows, [len(prompt)] * vocab, cfg, vocab, logits.device)     # the first token was generated
    p0 = target_probs(logits[:1, -2], cfg, seen0)[0]
    p1 = target_probs(logits[:, -1], cfg, seen1)
    return p0[:, None] * p1


def both_ways(results, least: int = 0) -> None:
    """The first draft position was offered more than `least` times over these samples and was neither always
    accepted nor always rejected: the distribution test exercised both branches of the rule."""
    offered = sum(r.stats.position_offered[0] for r in results if r.stats.position_offered)
    accepted = sum(r.stats.position_accepted[0] for r in results if r.stats.position_accepted)
    assert offered > least and 0.05 * offered < accepted < 0.95 * offered, "both acceptances and rejections happen"


DIST_CONFIGS = {
    "t1": SamplingConfig(temperature=1.0),
    "all": SamplingConfig(temperature=0.8, top_k=5, top_p=0.95, min_p=0.02, repetition_penalty=1.3),
    "openai": SamplingConfig(temperature=0.9, frequency_penalty=0.9, presence_penalty=0.5, logit_bias=((6, -100.0),
                                                                                                        (2, 0.7))),
    "min_tokens": SamplingConfig(temperature=1.0, min_new_tokens=2),     # no stop token (chosen below) in the two
}


@pytest.mark.parametrize("config", list(DIST_CONFIGS))
@pytest.mark.parametrize("method,draft", [("draft", "noisy_copy"), ("draft", "unrelated"), ("draft", "reduced_vocab"),
                                          ("ngram", None)])
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, small_drafts, method,
                                                       draft, config, fixed_verify_cost):
    """The first two tokens of many samples: the second comes from the first speculative step."""
    fixed_verify_cost(1.0)
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=DIST_SAMPLES, seed=11)
    law = cfg
    if cfg.min_new_tokens:          # the stop token: the likeliest first token; the law: the same ban as a bias
        unbanned = first_two_exact(small_target, DIST_PROMPT, dataclasses.replace(cfg, min_new_tokens=0))
        stop = int(unbanned.sum(1).argmax())
        assert unbanned.sum(1)[stop] > 0.2, "the ban matters"
        cfg = dataclasses.replace(cfg, stop_ids=(stop,))
        law = dataclasses.replace(cfg, logit_bias=((stop, -100.0),))
    eng = engine_for(method, small_target, small_drafts.get(draft))
    results = eng.generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    expected = first_two_exact(small_target, DIST_PROMPT, law).flatten()
    wrong = first_two_exact(small_drafts[draft], DIST_PROMPT, law).flatten() if draft else None
    follows(codes, expected, wrong)
    both_ways(results, DIST_SAMPLES // 3)


# --- bad input gets a clear UserError -----------------------------------------------------------------------------

@pytest.mark.parametrize("prompts,match", [
    ([], "no prompt"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1] * MAX_POSITIONS], f"prompt 0 has {MAX_POSITIONS} tokens"),
    ([[1] * (MAX_POSITIONS + 3)], "context"),
    ([[1, 2, 999]], "outside the vocabulary"),
    ([[1, -1]], "outside the vocabulary"),
])
def test_bad_prompts_are_user_errors(engine_for, llama, prompts, match):
    with pytest.raises(UserError, match=match):
        engine_for("plain", llama).generate(prompts, SamplingConfig(max_new_tokens=4))


def test_longest_allowed_prompt_is_accepted(engine_for, reference, llama):
    """max_position_embeddings - 1 prompt tokens leave room for exactly one generated token."""
    prompt = [3] * (MAX_POSITIONS - 1)
    first = next(iter(engine_for("plain", llama).stream([prompt], SamplingConfig(max_new_tokens=4))))
    assert first.tokens == reference(llama, prompt, 1) and first.finish == "length"


def test_a_draft_of_another_vocabulary_is_refused(llama, llama_other_vocab):
    cls = proposers.get("draft")
    with pytest.raises(UserError, match=r"96.*128|128.*96"):
        cls(Target(llama), cls.Options(), Target(llama_other_vocab))


def test_the_draft_method_needs_a_draft(llama):
    cls = proposers.get("draft")
    with pytest.raises(UserError, match="draft"):
        cls(Target(llama), cls.Options(), None)


def test_an_unknown_method_is_refused_with_the_choices():
    with pytest.raises(UserError, match="nope") as info:
        proposers.get("nope")
    for name in ("plain", "ngram", "draft"):
        assert name in str(info.value)


@pytest.mark.parametrize("method,options", [
    ("draft", dict(num_draft_tokens=0)),
    ("draft", dict(num_draft_tokens=8, max_draft_tokens=4)),
    ("draft", dict(confidence=1.0)),
    ("draft", dict(confidence=-0.1)),
    ("ngram", dict(num_draft_tokens=0)),
    ("ngram", dict(ngram_min=0)),
    ("ngram", dict(ngram_min=3, ngram_max=2)),
])
def test_bad_proposer_options_are_user_errors(method, options):
    with pytest.raises(UserError):
        proposers.get(method).Options(**options)


# --- the one-forward tree verification the engine relies on ------------------------------------------------------

TREE_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


@torch.inference_mode()
@pytest.mark.parametrize("model_name", ["llama", "gemma_sliding"])
def test_tree_forward_equals_a_plain_forward_of_each_path(request, model_name):
    """Logits at every node of a tree verified in one forward (4-D mask, explicit positions, ragged left-padded
    batch) equal a plain forward of prompt + that node's path; after keeping one path, the next forward equals a
    plain forward of prompt + path + next token."""
    model = request.getfixturevalue(model_name)
    target = Target(model)
    prompts = [list(range(20, 32)), [5, 6, 7]]                  # 12 tokens: beyond the sliding window of 8
    g = torch.Generator().manual_seed(0)
    tree = from_paths(torch.tensor([p[-1] for p in prompts]), TREE_PATHS,
                      torch.randint(0, 128, (2, len(TREE_PATHS)), generator=g))
    kv = target.new_state(2)
    target.prefill(kv, [p[:-1] for p in prompts])               # the root is pending, as in the engine
    start = kv.length
    positions = kv.next_positions()[:, None] + tree.depth                                 # [B, N]
    logits, _ = target.forward(kv, tree.tokens, positions, tree.ancestors)                # [B, N, V]
    for b, prompt in enumerate(prompts):
        for node in range(tree.size):
            path = [j for j in range(tree.size) if tree.ancestors[b, node, j]]            # root .. node
            ids = prompt[:-1] + tree.tokens[b, path].tolist()
            want = model(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(logits[b, node], want, rtol=1e-4, atol=1e-4)
    keep = torch.tensor([[0, 1, 4, 7], [0, 2, -1, -1]])         # row 0: root, [0], [0, 0], [0, 0, 0]; row 1: root, [1]
    counts = torch.tensor([4, 2])
    kv.keep(start, keep.clamp(min=0), counts)
    nxt = torch.tensor([[11], [12]])
    out, _ = target.forward(kv, nxt, kv.next_positions()[:, None], torch.ones(2, 1, 1, dtype=torch.bool))
    for b, prompt in enumerate(prompts):
        kept = keep[b, : counts[b]].tolist()
        ids = prompt[:-1] + tree.tokens[b, kept].tolist() + nxt[b].tolist()
        torch.testing.assert_close(out[b, -1], model(torch.tensor([ids])).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_a_proposer_that_declares_hidden_states_gets_them(llama):
    """Needs are declared, not special-cased: a proposer with needs_hidden_states sees the target's hidden states
    at prefill and at every tree node, and the output is still plain greedy."""
    seen = []

    class Probe(proposers.get("ngram")):
        needs_hidden_states = True

        def begin(self, ctx, hidden=None):
            seen.append(("begin", len(hidden), tuple(hidden[-1].shape)))
            super().begin(ctx, hidden)

        def observe(self, ctx, verdict, gained, hidden=None):
            seen.append(("observe", len(hidden), tuple(hidden[-1].shape[:2])))
            super().observe(ctx, verdict, gained, hidden)

    target = Target(llama)
    cfg = SamplingConfig(max_new_tokens=12)
    probe = Engine(target, Probe(target, Probe.Options())).generate([REPEATS], cfg)[0]
    plain = Engine(target, proposers.get("plain")(target, proposers.get("plain").Options())).generate([REPEATS], cfg)[0]
    assert probe.token_ids == plain.token_ids
    layers = llama.config.num_hidden_layers + 1
    assert seen[0] == ("begin", layers, (1, len(REPEATS), llama.config.hidden_size))
    assert all(kind == "observe" and n == layers and shape[0] == 1 for kind, n, shape in seen[1:])


@pytest.mark.parametrize("static", [False, True])
def test_a_step_keeps_only_the_hidden_states_a_proposer_reads(llama, static):
    """A proposer that names the hidden states it reads (hidden_layers) gets those at every step, equal to the same
    entries of the whole set, and None for the others (keeping them all costs the forward); at prefill it gets all."""
    seen = []
    last = llama.config.num_hidden_layers

    class Probe(proposers.get("ngram")):
        needs_hidden_states = True

        def hidden_layers(self):
            return (1, last)

        def observe(self, ctx, verdict, gained, hidden=None):
            seen.append(hidden)
            super().observe(ctx, verdict, gained, hidden)

    target = Target(llama, static=static)
    cfg = SamplingConfig(max_new_tokens=12)
    Engine(target, Probe(target, Probe.Options())).generate([REPEATS], cfg)
    assert seen and all(len(h) == last + 1 for h in seen)
    assert all((x is None) == (i not in (1, last)) for h in seen for i, x in enumerate(h))
    kv = target.new_state(1)
    kv.reserve(64)
    target.prefill(kv, [REPEATS])
    tokens, positions = torch.tensor([[3, 4]]), torch.tensor([[len(REPEATS), len(REPEATS) + 1]])
    tree = torch.ones(1, 2, 2, dtype=torch.bool).tril()
    kept = target.forward(kv.copied(), tokens, positions, tree, hidden=(1, last))[1]
    every = target.forward(kv.copied(), tokens, positions, tree, hidden=True)[1]
    for i in (1, last):
        assert torch.equal(kept[i], every[i])


def test_holes_are_compacted_and_output_is_unchanged(llama, llama_draft, engine_for, reference, monkeypatch):
    """Ragged batches leave holes in the cache; compaction (forced here at every step) keeps each row's slots in
    order and the output equals plain greedy."""
    from spekit.cache import KVState

    real = KVState.compact
    monkeypatch.setattr(KVState, "compact", lambda self, slack=0: real(self, slack=0))
    prompts = [DISTINCT, REPEATS, SHORT]
    for method in ("ngram", "draft_random"):
        results = engine(engine_for, method, llama, llama_draft).generate(prompts, SamplingConfig(max_new_tokens=N))
        assert [r.token_ids for r in results] == [reference(llama, p, N) for p in prompts], method


def test_compact_keeps_each_rows_slots_in_position_order():
    from spekit.cache import KVState

    kv = KVState(2, torch.device("cpu"), torch.float32)
    kv.slot_pos = torch.tensor([[-1, 0, 1, -1, 2, -1, 3], [0, -1, -1, 1, -1, -1, -1]])
    keys = kv.slot_pos[:, None, :, None].float().expand(2, 1, 7, 2).clone()
    kv.cache.update(keys, keys.clone(), 0)
    assert kv.compact(slack=0)
    assert kv.slot_pos.tolist() == [[0, 1, 2, 3], [-1, -1, 0, 1]]
    assert kv.cache.layers[0].keys[:, 0, :, 0].tolist() == [[0, 1, 2, 3], [-1, -1, 0, 1]]
