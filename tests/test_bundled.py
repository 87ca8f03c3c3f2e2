"""On the bundled SmolLM2-135M (slow: loads the real model): every lossless method reproduces plain greedy
output token for token, batched and alone, and the CLI's main job runs."""
from __future__ import annotations

import json

import pytest

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarize: The city council met on Tuesday to discuss the new park. The council approved the park budget "
    "and said the park will open next spring. The park will have a playground, a pond and a small garden.",
    "Write a Python function that returns the squares of a list of numbers.",
]


@pytest.fixture(scope="module")
def smollm():
    return Spekit.load("smollm2-135m")


def test_every_method_equals_plain_greedy(smollm):
    cfg = SamplingConfig(max_new_tokens=40)
    ids = [smollm.encode(p) for p in PROMPTS]
    plain = smollm.engine.generate(ids, cfg)
    for method, options in [("ngram", {}), ("ngram", {"ngram_max": 2, "num_draft_tokens": 4}),
                            ("draft", {"confidence": 0.0})]:
        draft = smollm.loaded if method == "draft" else None
        sk = smollm.with_method(method, draft, **options)
        batched = sk.engine.generate(ids, cfg)
        assert [r.token_ids for r in batched] == [r.token_ids for r in plain], method
        alone = sk.engine.generate([ids[0]], cfg)[0]
        assert alone.token_ids == plain[0].token_ids
    assert all(r.stats.tau == 1.0 for r in plain)


def test_draft_equal_to_target_is_accepted(smollm, always_draft):
    sk = smollm.with_method("draft", smollm.loaded, confidence=0.0)
    result = sk.engine.generate([smollm.encode(PROMPTS[1])], SamplingConfig(max_new_tokens=32))[0]
    assert result.stats.tau > 3


def test_generate_json_on_the_bundled_model(capsys):
    assert main(["generate", "--method", "ngram", "--max-new-tokens", "16", "--json", PROMPTS[0]]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["method"] == "ngram" and row["new_tokens"] == len(row["token_ids"]) > 0
    assert row["mean_accepted"] >= 1.0 and row["text"]


def test_structured_output_on_the_bundled_model(smollm):
    """A JSON schema on the real tokenizer: the answer parses and follows it, and the shipped EAGLE-3 head gives
    plain's constrained answer."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "season": {"enum": ["spring", "summer"]},
                                               "things": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 3}},
              "required": ["city", "season", "things"], "additionalProperties": False}
    cfg = SamplingConfig(max_new_tokens=80, json_schema=json.dumps(schema))
    prompt = PROMPTS[0] + " Answer in JSON."
    [plain] = smollm.generate([prompt], cfg)
    data = json.loads(plain.text)
    assert set(data) == {"city", "season", "things"} and data["season"] in ("spring", "summer")
    assert plain.result.finish_reason == "stop"
    [eagle3] = smollm.with_method("eagle3").generate([prompt], cfg)
    assert eagle3.result.token_ids == plain.result.token_ids


@pytest.mark.parametrize("dtype,quantize", [("bfloat16", "none"), ("float32", "int4")])
def test_low_precision_methods_equal_their_plain_greedy(dtype, quantize):
    """bfloat16 and int4 are other models (in their last bits), decoded losslessly by every method: a draft that
    is always verified (the model itself) and the shipped EAGLE-3 head give plain's tokens, batched and alone, and
    plain's log-probabilities bit for bit."""
    base = Spekit.load("smollm2-135m", dtype=dtype, quantize=quantize)
    cfg = SamplingConfig(max_new_tokens=40, top_logprobs=2)
    ids = [base.encode(p) for p in PROMPTS]
    results = base.engine.generate(ids, cfg)
    plain = [r.token_ids for r in results]
    for method, draft, options in [("ngram", None, {}), ("draft", base.loaded, {"confidence": 0.0}),
                                   ("eagle3", None, {})]:
        sk = base.with_method(method, draft, **options)
        batched = sk.engine.generate(ids, cfg)
        assert [r.token_ids for r in batched] == plain, method
        assert [r.logprobs for r in batched] == [r.logprobs for r in results], method
        assert sk.engine.generate([ids[1]], cfg)[0].token_ids == plain[1], method
