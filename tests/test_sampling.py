"""Logits processing matches transformers, in transformers' order; bad settings are refused with a UserError."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from spekit import sampling
from spekit.config import SamplingConfig, UserError

B, V, L = 16, 50, 12

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.8),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, top_p=0.05),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.0, min_p=0.5),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=1.0, repetition_penalty=0.7),
    dict(temperature=0.6, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    dict(temperature=1.5, top_k=20, top_p=0.7, min_p=0.2, repetition_penalty=1.5),
    dict(temperature=0.3, top_k=3, top_p=0.95),
]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3          # [B, V], both signs (the penalty treats them apart)
    ids = torch.randint(0, V, (B, L), generator=g)        # [B, L] context tokens
    return logits, ids


def hf_processors(cfg: SamplingConfig) -> LogitsProcessorList:
    """transformers' processors for cfg, in the order its generate() appends them."""
    procs = LogitsProcessorList()
    if cfg.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    procs.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k:
        procs.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(cfg.top_p))
    if cfg.min_p > 0:
        procs.append(MinPLogitsWarper(cfg.min_p))
    return procs


def presence(ids: torch.Tensor) -> sampling.Seen:
    """What the processing sees of contexts ids [B, L] (all of it prompt: no generated tokens to count)."""
    return sampling.Seen(sampling.seen_of(ids.tolist(), [ids.shape[1]] * ids.shape[0],
                                          SamplingConfig(repetition_penalty=2.0), V, ids.device).presence)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_target_probs_equal_transformers_processing(settings, seed):
    logits, ids = _inputs(seed)
    cfg = SamplingConfig(**settings)
    expected = hf_processors(cfg)(ids, logits.clone()).softmax(dim=-1)
    got = sampling.target_probs(logits, cfg, presence(ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, expected > 0), "the same tokens are removed"


@pytest.mark.parametrize("settings", SETTINGS[3:], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_target_probs_equal_the_processors_generate_builds(llama, settings):
    """The same, against the list generate() itself builds from a GenerationConfig: this pins the order."""
    logits, ids = _inputs(3)
    cfg = SamplingConfig(**settings)
    gen = GenerationConfig(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           min_p=cfg.min_p if cfg.min_p > 0 else None, repetition_penalty=cfg.repetition_penalty)
    procs = llama._get_logits_processor(gen, input_ids_seq_length=L, device="cpu")
    expected = procs(ids, logits.clone()).softmax(dim=-1)
    torch.testing.assert_close(sampling.target_probs(logits, cfg, presence(ids)), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.6])
def test_greedy_is_argmax_of_penalised_logits(penalty):
    logits, ids = _inputs(4)
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=penalty)
    scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone()) if penalty != 1.0 else logits
    best = scores.argmax(dim=-1)
    probs = sampling.target_probs(logits, cfg, presence(ids))
    assert torch.equal(probs, torch.nn.functional.one_hot(best, V).float())
    assert torch.equal(sampling.greedy_tokens(logits, cfg, presence(ids)), best)


def test_penalty_without_presence_is_a_no_op():
    logits, _ = _inputs(5)
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=1.5)
    torch.testing.assert_close(sampling.target_probs(logits, cfg, None), logits.softmax(-1))


def test_target_probs_keep_leading_dims():
    """[B, N, V] logits (one distribution per tree node) are processed row by row."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 4, V, generator=g) * 3
    pres = torch.rand(3, 4, V, generator=g) < 0.2
    counts = torch.randint(0, 3, (3, 4, V), generator=g).float()
    cfg = SamplingConfig(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                         frequency_penalty=0.3, presence_penalty=0.2, logit_bias=((4, 2.0),))
    flat = sampling.target_probs(logits.reshape(12, V), cfg,
                                 sampling.Seen(pres.reshape(12, V), counts.reshape(12, V))).reshape(3, 4, V)
    torch.testing.assert_close(sampling.target_probs(logits, cfg, sampling.Seen(pres, counts)), flat)


def test_row_generators_are_reproducible_and_independent():
    probs = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(7)), dim=-1)
    a = sampling.row_sample(probs, sampling.make_generators([10, 11, 12, 13]))
    b = sampling.row_sample(probs, sampling.make_generators([10, 11, 12, 13]))
    assert torch.equal(a, b)
    # a row's draw depends on its own seed only, not on its neighbours
    c = sampling.row_sample(probs[2:3], sampling.make_generators([12]))
    assert c.item() == a[2].item()


def test_row_sample_follows_probs():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    gens = sampling.make_generators([0])
    draws = torch.cat([sampling.row_sample(probs, gens) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[3] == 0
    assert (freq - probs[0]).abs().max() < 0.03


# --- OpenAI's frequency and presence penalties, logit bias -------------------------------------------------------

def test_logit_bias_equals_transformers_sequence_bias():
    logits, ids = _inputs(8)
    bias = ((3, 2.5), (7, -100.0), (0, 0.75))
    cfg = SamplingConfig(temperature=0.9, logit_bias=bias)
    hf = LogitsProcessorList([SequenceBiasLogitsProcessor({(t,): b for t, b in bias}),
                              TemperatureLogitsWarper(cfg.temperature)])
    torch.testing.assert_close(sampling.target_probs(logits, cfg, None), hf(ids, logits.clone()).softmax(-1))
    assert bool((sampling.target_probs(logits, cfg, None)[:, 7] < 1e-30).all()), "-100 bans a token"


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    """OpenAI's definition: logit - count * frequency_penalty - (count > 0) * presence_penalty, where count is the
    token's occurrences among the generated tokens; the prompt's tokens are not counted (as vLLM)."""
    prompt, generated = [1, 2, 2, 9], [2, 5, 5, 5, 3]
    cfg = SamplingConfig(temperature=1.0, frequency_penalty=0.6, presence_penalty=0.4)
    seen = sampling.seen_of([prompt + generated], [len(prompt)], cfg, V, "cpu")
    assert seen.presence is None, "no repetition penalty: no presence needed"
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(9))
    expected = logits.clone()
    for tok in set(generated):
        expected[0, tok] -= generated.count(tok) * 0.6 + 0.4
    torch.testing.assert_close(sampling.penalize(logits, seen, cfg), expected)
    assert sampling.seen_of([prompt], [len(prompt)], SamplingConfig(), V, "cpu") is None, "nothing to penalise"


def test_penalties_apply_after_the_repetition_penalty_and_in_greedy():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.1)
    seen = sampling.seen_of([[0, 3, 0]], [1], cfg, 4, "cpu")            # generated: 3, 0
    expected = torch.tensor([[2.0 / 2 - 0.5 - 0.1, 1.9, -1.0, 0.5 / 2 - 0.5 - 0.1]])
    torch.testing.assert_close(sampling.penalize(logits, seen, cfg), expected)
    assert sampling.greedy_tokens(logits, cfg, seen).item() == 1


def test_seen_add_follows_a_drafters_tokens():
    cfg = SamplingConfig(temperature=1.0, repetition_penalty=1.5, frequency_penalty=1.0)
    seen = sampling.seen_of([[1, 2], [3]], [1, 1], cfg, V, "cpu")
    seen.add(torch.tensor([0, 1]), torch.tensor([2, 4]), where=torch.tensor([True, False]))
    assert seen.counts[0, 2] == 2 and seen.counts[1, 4] == 0
    assert bool(seen.presence[0, 2]) and not bool(seen.presence[1, 4])


def test_logit_bias_outside_the_vocabulary_is_a_user_error():
    with pytest.raises(UserError, match="vocabulary has 50 tokens"):
        sampling.check_bias(SamplingConfig(logit_bias=((50, 1.0),)), V)


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.01),
    dict(min_p=-0.1), dict(min_p=1.0),
    dict(top_k=-1),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
    dict(frequency_penalty=float("nan")), dict(presence_penalty=float("inf")),
    dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((3, 101.0),)), dict(logit_bias=((3, float("nan")),)),
    dict(logit_bias=((3, 1.0), (3, 2.0))),
    dict(max_new_tokens=0),
    dict(n=0),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampling_config_rejects_bad_values(bad):
    name = next(iter(bad))
    with pytest.raises(UserError, match=name):
        SamplingConfig(**bad)


def test_sampling_config_accepts_the_boundaries_and_is_frozen():
    cfg = SamplingConfig(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, max_new_tokens=1, n=1)
    assert cfg.greedy
    assert not SamplingConfig(temperature=1e-3).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 1.0  # type: ignore[misc]


def test_user_error_is_a_value_error():
    assert issubclass(UserError, ValueError)


def test_the_fast_argmax_is_torchs_argmax_ties_and_shapes_included():
    """sampling.argmax (numpy's scan for float32 on the host) gives torch.argmax's index everywhere: ties go to the
    first maximum, any leading shape, a strided view, -inf rows, other dtypes through torch."""
    from spekit.sampling import argmax
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 11), (2, 4, 50), (1, 1, 262144)]:
        x = torch.randn(shape, generator=g)
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    tied = torch.tensor([[0.0, 3.0, 3.0, 1.0], [float("-inf")] * 4, [2.0, 2.0, 2.0, 2.0]])
    assert argmax(tied).tolist() == tied.argmax(dim=-1).tolist() == [1, 0, 0]
    strided = torch.randn(6, 8, generator=g)[:, ::2]
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))
    half = torch.randn(3, 9, generator=g).bfloat16()
    assert torch.equal(argmax(half), half.argmax(dim=-1))
    assert argmax(torch.randn(5, generator=g)).dtype == torch.long
