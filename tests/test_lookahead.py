"""Lookahead and Jacobi decoding: both reproduce plain greedy decoding exactly (tiny Llama, tiny Gemma with sliding
windows, ragged batches, at the end of the context); sampled outputs follow the target distribution; bad sizes are
UserErrors. And the engine's side nodes (which lookahead's branch runs on) see exactly what they should."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from spekit import proposers
from spekit.config import SamplingConfig, UserError
from spekit.proposers import Proposer, SideNodes
from spekit.backends.torch_target import Target
from spekit.proposers.lookahead import LookaheadOptions, _Row
from spekit.tree import chain
from test_engine import DIST_CONFIGS, DIST_PROMPT, DIST_SAMPLES, V_SMALL, both_ways, first_two_exact
from conftest import PENALISED, penalised_greedy

DISTINCT = [5, 17, 42, 9, 3, 88, 61, 120, 33]
REPEATS = [7, 8, 9, 10] * 5
SHORT = [1]
N = 32
MAX_POSITIONS = 512

# (method, options): defaults, tiny and wide sizes
CASES = [
    ("lookahead", {}),
    ("lookahead", dict(window=1, ngram=2, guesses=1)),
    ("lookahead", dict(window=7, ngram=5, guesses=6)),
    ("jacobi", {}),
    ("jacobi", dict(block_size=1)),
    ("jacobi", dict(block_size=9)),
]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'default'}" for m, o in CASES]


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_greedy_equals_hf_greedy_alone_and_batched(engine_for, reference, llama, always_draft, method, options):
    """Prompts of different lengths, two samples each, decoded together, then one alone."""
    prompts = [DISTINCT, REPEATS, SHORT, list(range(2, 40, 3))]
    eng = engine_for(method, llama, **options)
    results = eng.generate(prompts, SamplingConfig(max_new_tokens=N, n=2))
    for r in results:
        assert r.token_ids == reference(llama, prompts[r.prompt_index], N), (r.prompt_index, r.sample_index)
    [alone] = engine_for(method, llama, **options).generate([REPEATS], SamplingConfig(max_new_tokens=N))
    assert alone.token_ids == reference(llama, REPEATS, N)


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_greedy_with_sliding_window_layers_equals_hf(engine_for, reference, gemma_sliding, always_draft, method,
                                                     options):
    """Gemma 3 with window-8 sliding layers, decoded far past the window, ragged batch."""
    prompts = [[3, 4, 5, 6, 7], [9, 10, 11] * 4, SHORT]
    results = engine_for(method, gemma_sliding, **options).generate(prompts, SamplingConfig(max_new_tokens=40))
    for r in results:
        assert r.token_ids == reference(gemma_sliding, prompts[r.prompt_index], 40), r.prompt_index


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_decoding_up_to_the_context_limit(engine_for, reference, llama, always_draft, method, options):
    """Side nodes and drafts beyond the context are cut; the row stops with "length" once it is full."""
    prompt = (list(range(100, 128)) * 20)[: MAX_POSITIONS - 9]
    [r] = engine_for(method, llama, **options).generate([prompt], SamplingConfig(max_new_tokens=50))
    assert len(prompt) + len(r.token_ids) == MAX_POSITIONS and r.finish_reason == "length"
    assert r.token_ids == reference(llama, prompt, 9)


@pytest.mark.parametrize("method", ["lookahead", "jacobi"])
def test_they_speculate_where_it_pays(engine_for, llama, always_draft, method):
    """On a text the tiny model repeats, both draft, and lookahead gains several tokens per forward."""
    [r] = engine_for(method, llama).generate([REPEATS], SamplingConfig(max_new_tokens=60))
    assert sum(r.stats.position_offered) > 0
    if method == "lookahead":
        assert r.stats.tau > 1.5


@pytest.mark.parametrize("method", ["lookahead", "jacobi"])
def test_they_back_off_to_plain_steps_when_drafts_do_not_pay(engine_for, reference, llama, monkeypatch,
                                                             forward_widths, method):
    """A multi-token forward measured 5x dearer than a one-token forward: (nearly) every step is one token."""
    from spekit.pacing.step_costs import StepCosts
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 5.0)
    eng = engine_for(method, llama)
    monkeypatch.setattr(eng, "_calibrate", lambda kv, ctx: None)
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=40))
    assert r.token_ids == reference(llama, DISTINCT, 40)
    steps = forward_widths[1:]                                    # after the prefill
    assert sum(s == 1 for s in steps) >= 0.9 * len(steps), steps


@pytest.mark.parametrize("config", list(DIST_CONFIGS))
@pytest.mark.parametrize("method,options", [("lookahead", {}), ("lookahead", dict(window=2, ngram=2, guesses=3)),
                                            ("jacobi", {})])
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, method, options, config):
    """The first two tokens of many samples: the second comes from the first speculative step."""
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=DIST_SAMPLES, seed=11)
    results = engine_for(method, small_target, **options).generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results, DIST_SAMPLES // 3)


@pytest.mark.parametrize("method", ["lookahead", "jacobi"])
def test_seeded_sampling_repeats_and_rows_do_not_depend_on_their_batch(engine_for, llama, method):
    cfg = SamplingConfig(temperature=1.0, top_k=50, max_new_tokens=N, n=2, seed=3)
    batch = [DISTINCT, REPEATS, SHORT]
    together = engine_for(method, llama).generate(batch, cfg)
    alone = [r for p in batch for r in engine_for(method, llama).generate([p], cfg)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("method,options,match", [
    ("lookahead", dict(window=0), "window must be >= 1"),
    ("lookahead", dict(ngram=1), "ngram must be >= 2"),
    ("lookahead", dict(guesses=0), "guesses must be >= 1"),
    ("lookahead", dict(window=-3), "window"),
    ("lookahead", dict(window=MAX_POSITIONS), "context"),
    ("lookahead", dict(ngram=MAX_POSITIONS + 1), "context"),
    ("jacobi", dict(block_size=0), "block_size must be >= 1"),
    ("jacobi", dict(block_size=MAX_POSITIONS), "context"),
])
def test_bad_sizes_are_user_errors(llama, method, options, match):
    cls = proposers.get(method)
    with pytest.raises(UserError, match=match):
        cls(Target(llama), cls.Options(**options))


# --- the engine's side nodes ------------------------------------------------------------------------------------

class _Probe(Proposer):
    """Drafts nothing; runs `side` as side nodes after the pending token (a chain, positions p+1...) and keeps
    the logits it is handed."""
    name = "probe"
    needs_logits = True

    def __init__(self, target, side: list[int]):
        super().__init__(target, None)
        self.side, self.seen = side, []

    def propose(self, ctx):
        empty = ctx.pending[:, None][:, :0]
        return chain(ctx.pending, empty, torch.zeros_like(ctx.pending))

    def side_nodes(self, ctx):
        m, batch = len(self.side), ctx.pending.shape[0]
        tokens = torch.tensor(self.side).expand(batch, m)
        positions = ctx.positions[:, None] + 1 + torch.arange(m)
        return SideNodes(tokens, positions, torch.ones(m, m, dtype=torch.bool).tril().expand(batch, m, m))

    def observe(self, ctx, verdict, gained, hidden=None, logits=None):
        self.seen.append((list(ctx.tokens[0]), logits[0].clone()))


@torch.inference_mode()
def test_a_candidate_found_in_the_text_runs_on_with_the_text():
    """Lookahead's pool keys n-grams by their first token; one that occurs in the text continues with the text after
    it (a copy run), up to num_draft_tokens, and the occurrence that follows the same two tokens ranks first."""
    passage = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    tokens = [5, 9, 9, 7] + passage + [20, 33, 34, 35, 7, 20]      # "7 20" again: copy the passage after it
    row = _Row(tokens, LookaheadOptions(ngram=3, guesses=2, num_draft_tokens=6))
    row.feed(tokens)
    [(best, source), *_] = row.candidates(tokens)
    assert source == "text" and best == tuple(passage[1:7])
    short = _Row(tokens, LookaheadOptions(ngram=3, guesses=2, num_draft_tokens=1))
    short.feed(tokens)
    assert short.candidates(tokens)[0][0] == tuple(passage[1:3])          # never shorter than the n-gram


def test_side_nodes_see_the_context_and_the_pending_token_and_leave_no_trace(llama, reference):
    from spekit.engine import Engine
    side = [11, 12, 13]
    probe = _Probe(Target(llama), side)
    [r] = Engine(probe.target, probe).generate([DISTINCT], SamplingConfig(max_new_tokens=6))
    assert r.token_ids == reference(llama, DISTINCT, 6), "side nodes change nothing"
    for context, logits in probe.seen:
        full = llama(torch.tensor([context + side])).logits[0, len(context) - 1:]        # [1 + M, V]
        assert logits.shape == full.shape
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("method,options", [("lookahead", {}), ("lookahead", dict(window=3, ngram=3, guesses=2)),
                                            ("jacobi", {})])
def test_bundled_model_equals_plain_greedy(always_draft, method, options):
    from spekit.api import Spekit
    sk = Spekit.load("smollm2-135m")
    ids = [sk.encode("Summarize: the council approved the park budget; the park opens next spring."),
           sk.encode("Write a Python function that returns the squares of a list.")]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = sk.engine.generate(ids, cfg)
    batched = sk.with_method(method, **options).engine.generate(ids, cfg)
    assert [r.token_ids for r in batched] == [r.token_ids for r in plain]


@pytest.mark.parametrize("method", ["lookahead", "jacobi"])
def test_greedy_with_penalties_and_logit_bias_equals_plain(engine_for, llama, always_draft, method):
    prompts = [DISTINCT, REPEATS, SHORT]
    results = engine_for(method, llama).generate(prompts, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in prompts]


def test_sampled_jacobi_tries_a_failing_block_less_and_less(engine_for, llama):
    """Under sampling no timed guard holds drafts back, so Jacobi's own pacing must: on a random model its blocks
    are never accepted, and after each failure a row waits longer before it tries again (at a fixed pace it tried
    33 blocks in 300 steps)."""
    cfg = SamplingConfig(max_new_tokens=300, temperature=1.0, seed=0)
    stats = engine_for("jacobi", llama).generate([DISTINCT], cfg)[0].stats
    assert sum(stats.position_accepted) == 0 and stats.target_forwards == 300
    assert 1 <= stats.position_offered[0] <= 12
