"""Log-probabilities of the committed tokens (`logprobs` / `top_logprobs`): whatever drafted them, they are the
target's own raw log-probabilities at each place of the text, the ones plain decoding reports (bit for bit where
verification rows equal plain steps, in bfloat16; to float32 rounding in float32); one per committed token, cut
with the text at a stop or a length limit; and a row that does not ask pays nothing."""
from __future__ import annotations

import json

import pytest
import torch

from spekit.commands import main
from spekit.config import SamplingConfig, UserError
from test_invariant import low_precision

from conftest import tiny_llama

PROMPTS = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10] * 5, [1]]
N = 20
# method -> (proposer, draft: "self" = the target drafting for itself, accepted every time), options
METHODS = {
    "plain": ("plain", None, {}),
    "ngram": ("ngram", None, {}),
    "draft_self": ("draft", "self", {"confidence": 0.0}),
    "early-exit": ("early-exit", None, {"exit_layer": 1, "confidence": 0.0}),
}


def _run(engine_for, model, method: str, cfg: SamplingConfig, prompts=PROMPTS):
    name, draft, options = METHODS[method]
    return engine_for(name, model, model if draft == "self" else None, **options).generate(prompts, cfg)


@torch.inference_mode()
def _reference(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole text: log_softmax at the places that predicted `new` [len(new), V]."""
    ids = torch.tensor([prompt + new])
    logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(new)], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", list(METHODS))
def test_float32_logprobs_are_the_targets_own(engine_for, always_draft, method, temperature):
    model = tiny_llama(seed=0)
    cfg = SamplingConfig(max_new_tokens=N, temperature=temperature, seed=3, top_logprobs=3)
    results = _run(engine_for, model, method, cfg)
    assert sum(sum(r.stats.position_offered) for r in results) > 0 or method == "plain"
    for r in results:
        assert [e.token for e in r.logprobs] == r.token_ids
        ref = _reference(model, r.prompt_ids, r.token_ids)
        chosen = ref.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in r.logprobs]), chosen, atol=1e-4)
        values, ids = ref.topk(3, dim=-1)
        for e, v, i in zip(r.logprobs, values, ids):
            assert [t for t, _ in e.top] == i.tolist()
            assert torch.allclose(torch.tensor([lp for _, lp in e.top]), v, atol=1e-4)
            if temperature == 0:                        # greedy: the chosen token is the most likely one
                assert e.token == e.top[0][0] and e.logprob == e.top[0][1]


@pytest.mark.parametrize("method", ["ngram", "draft_self", "early-exit"])
def test_bfloat16_logprobs_equal_plains_bit_for_bit(engine_for, always_draft, method):
    model = low_precision("bfloat16")
    cfg = SamplingConfig(max_new_tokens=N, top_logprobs=2)
    want = _run(engine_for, model, "plain", cfg)
    got = _run(engine_for, model, method, cfg)
    assert sum(sum(r.stats.position_offered) for r in got) > 0, "no draft was verified"
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs                 # TokenLogprob equality: the same floats


def test_one_entry_per_token_cut_at_stops_and_limits(engine_for, always_draft):
    model = tiny_llama(seed=0)
    free = _run(engine_for, model, "draft_self", SamplingConfig(max_new_tokens=N, logprobs=True))[1]
    stop = free.token_ids[5]
    cut = _run(engine_for, model, "draft_self", SamplingConfig(max_new_tokens=N, logprobs=True, stop_ids=(stop,)))
    short = _run(engine_for, model, "draft_self", SamplingConfig(max_new_tokens=3, logprobs=True))
    for r in cut + short:
        assert len(r.logprobs) == len(r.token_ids) and [e.token for e in r.logprobs] == r.token_ids
    assert cut[1].logprobs == free.logprobs[: free.token_ids.index(stop) + 1]
    assert all(e.top == () for e in free.logprobs)     # logprobs without top_logprobs: the chosen token only


def test_rows_that_do_not_ask_get_none(engine_for):
    results = _run(engine_for, tiny_llama(seed=0), "ngram", SamplingConfig(max_new_tokens=4))
    assert all(r.logprobs is None and "logprobs" not in r.as_dict() for r in results)


def test_top_logprobs_out_of_range_is_a_user_error():
    with pytest.raises(UserError, match="top_logprobs"):
        SamplingConfig(top_logprobs=21)
    assert SamplingConfig(top_logprobs=2).wants_logprobs and not SamplingConfig().wants_logprobs


def test_cli_json_names_the_tokens(tmp_path, capsys):
    from test_cli import _save_tiny
    model = _save_tiny(tmp_path / "m")
    assert main(["generate", "--model", model, "--raw", "--json", "--max-new-tokens", "5", "--top-logprobs", "2",
                 "--method", "ngram", "the quick brown fox"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    assert all(isinstance(e["token"], str) and len(e["top_logprobs"]) == 2 for e in out["logprobs"])
    assert main(["generate", "--model", model, "--logprobs", "the quick brown fox"]) == 2
    assert "--json" in capsys.readouterr().err
