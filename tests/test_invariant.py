"""Lossless in low precision: on a bfloat16 or quantized (int8 / int4) CPU model, a token's logits in a
verification forward (a chain or a tree of drafts) equal, bit for bit, its logits in a plain one-token step; so
every method reproduces that model's own plain greedy output token for token (spekit.backends.row_invariant)."""
from __future__ import annotations

import pytest
import torch

from spekit.backends import row_invariant as invariant
from spekit.config import SamplingConfig
from spekit.backends.weight_quant import quantize
from spekit.batching import Session
from spekit.backends.torch_target import Target

from conftest import tiny_gemma3, tiny_llama
from test_session import _run

PROMPT = [5, 17, 42, 9, 3, 88, 61]
N = 24


def low_precision(kind: str, hidden: int = 256):
    """A tiny Llama wide enough (256) for bfloat16 kernels to round a one-row product differently."""
    model = tiny_llama(seed=0, hidden=hidden)
    if kind == "bfloat16":
        return model.bfloat16()
    quantize(model, kind)
    return model


def plain_steps(target: Target, prompt: list[int], n: int):
    """Greedy one-token steps: (tokens, logits [n, V] of each step's forward)."""
    kv = target.new_state(1)
    kv.reserve(len(prompt) + n)
    logits = target.prefill(kv, [prompt])[0]
    tokens, rows = [], []
    for i in range(n):
        tokens.append(int(logits[0].argmax()))
        out, _ = target.forward(kv, torch.tensor([tokens[-1:]]), torch.tensor([[len(prompt) + i]]),
                                torch.ones(1, 1, 1, dtype=torch.bool))
        logits = out[:, 0]
        rows.append(out[0, 0])
    return tokens, torch.stack(rows)


def chained(target: Target, prompt: list[int], tokens: list[int], chunk: int) -> torch.Tensor:
    """The same tokens verified `chunk` at a time: logits [len(tokens), V]."""
    kv = target.new_state(1)
    kv.reserve(len(prompt) + len(tokens))
    target.prefill(kv, [prompt])
    rows = []
    for s in range(0, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        positions = torch.arange(len(prompt) + s, len(prompt) + s + len(piece))[None]
        causal = torch.ones(len(piece), len(piece), dtype=torch.bool).tril()[None]
        rows.append(target.forward(kv, torch.tensor([piece]), positions, causal)[0][0])
    return torch.cat(rows)


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("chunk", [2, 5])
def test_verification_rows_equal_plain_steps_bit_for_bit(kind, chunk):
    target = Target(low_precision(kind))
    tokens, steps = plain_steps(target, PROMPT, N)
    assert torch.equal(chained(target, PROMPT, tokens, chunk), steps)


def test_one_row_linears_are_padded_where_they_would_round_otherwise(monkeypatch):
    """The probe catches a kernel whose one-row product rounds differently (a stand-in that nudges one-row results
    by an ulp); a model's linears are padded exactly where the probe says so, and its verification rows equal its
    plain steps bit for bit either way: as probed on this CPU, and padded everywhere (as on one with AVX-512 bf16,
    whose one-row path rounds differently)."""
    weight = torch.randn(48, 32).bfloat16()

    def one_row_differs(x, w, b):
        out = torch.nn.functional.linear(x, w, b)
        return out.nextafter(out + 1) if x.shape[0] == 1 else out

    invariant._ONE_ROW.clear()
    assert not invariant.one_row_invariant(weight, None, linear=one_row_differs)
    invariant._ONE_ROW.clear()
    probe = invariant.one_row_invariant
    for verdict in (probe, lambda w, b, linear=None: False):
        monkeypatch.setattr(invariant, "one_row_invariant", verdict)
        target = Target(low_precision("bfloat16"))
        for m in target.model.modules():
            if type(m) is torch.nn.Linear:
                assert (m.forward.__func__ is invariant._padded_linear) == (not verdict(m.weight, m.bias))
        tokens, steps = plain_steps(target, PROMPT, N)
        assert torch.equal(chained(target, PROMPT, tokens, 5), steps)


def test_the_stock_bfloat16_forms_would_differ(monkeypatch):
    """The check above can tell: without the row-invariant forms, chunked rows round differently."""
    monkeypatch.setattr(invariant, "needed", lambda model: False)
    target = Target(low_precision("bfloat16"))
    tokens, steps = plain_steps(target, PROMPT, N)
    assert not torch.equal(chained(target, PROMPT, tokens, 5), steps)


@pytest.mark.parametrize("kind", ["bfloat16", "int4"])
def test_a_tree_node_equals_the_same_token_in_a_chain(kind):
    """Tree [root, a, x, b] with x a sibling of a and b a child of a: root, a and b equal the chain root, a, b."""
    target = Target(low_precision(kind))
    tokens, steps = plain_steps(target, PROMPT, 4)
    root, a, b = tokens[:3]
    x = (a + 1) % 128
    kv = target.new_state(1)
    kv.reserve(len(PROMPT) + 8)
    target.prefill(kv, [PROMPT])
    p = len(PROMPT)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None]
    logits, _ = target.forward(kv, torch.tensor([[root, a, x, b]]), torch.tensor([[p, p + 1, p + 1, p + 2]]), mask)
    assert torch.equal(logits[0, [0, 1, 3]], steps[:3])


def test_a_bfloat16_model_gets_the_invariant_forms_and_a_float32_one_does_not():
    assert invariant.needed(tiny_llama(seed=0).bfloat16())
    assert not invariant.needed(tiny_llama(seed=0))
    quantized = tiny_llama(seed=0)
    quantize(quantized, "int8")
    assert invariant.needed(quantized)


CASES = {
    "ngram": ("ngram", False, {}),
    "draft (itself)": ("draft", True, {"confidence": 0.0}),
    "draft (another model)": ("draft", "other", {}),
    "lookahead": ("lookahead", False, {}),
    "jacobi": ("jacobi", False, {}),
    "recycle": ("recycle", False, {}),
    "early-exit": ("early-exit", False, {"exit_layer": 1, "confidence": 0.0}),
}


@pytest.mark.parametrize("kind", ["bfloat16", "int4"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_method_reproduces_plain_greedy_in_low_precision(engine_for, always_draft, kind, case):
    method, draft, options = CASES[case]
    model = low_precision(kind)
    other = tiny_llama(seed=1, layers=1, hidden=256).bfloat16() if draft == "other" else None
    prompts = [PROMPT, [7, 8, 9, 10] * 5, [1]]
    cfg = SamplingConfig(max_new_tokens=N)
    want = [r.token_ids for r in engine_for("plain", model).generate(prompts, cfg)]
    eng = engine_for(method, model, model if draft is True else other, **options)
    results = eng.generate(prompts, cfg)
    assert [r.token_ids for r in results] == want
    assert sum(sum(r.stats.position_offered) for r in results) > 0, "no draft was verified"
    if draft is True:                           # the model drafting for itself: every draft is accepted
        assert all(sum(r.stats.position_accepted) > 0 for r in results)


def test_a_bfloat16_sliding_window_model_reproduces_its_plain_greedy(engine_for, always_draft):
    model = tiny_gemma3(seed=0).bfloat16()
    prompts = [list(range(3, 40, 2)), [7, 8, 9, 10] * 5]
    cfg = SamplingConfig(max_new_tokens=N)
    want = [r.token_ids for r in engine_for("plain", model).generate(prompts, cfg)]
    assert [r.token_ids for r in engine_for("ngram", model).generate(prompts, cfg)] == want


def test_the_cache_holds_the_models_values_in_float64():
    """The float64 cache (read by the attention without a conversion per step) stores exactly what a bfloat16 cache
    would: every value converts back to bfloat16 unchanged."""
    target = Target(low_precision("bfloat16"))
    kv = target.new_state(1)
    kv.reserve(len(PROMPT) + 2)
    target.prefill(kv, [PROMPT])
    target.forward(kv, torch.tensor([[3, 4]]), torch.tensor([[len(PROMPT), len(PROMPT) + 1]]),
                   torch.ones(1, 2, 2, dtype=torch.bool).tril())
    for layer in kv.cache.layers:
        assert layer.keys.dtype == torch.float64 and layer.keys.shape[2] == len(PROMPT) + 2
        assert torch.equal(layer.keys.to(torch.bfloat16).double(), layer.keys)
        assert torch.equal(layer.values.to(torch.bfloat16).double(), layer.values)


@pytest.mark.parametrize("method", ["plain", "ngram", "lookahead"])
def test_a_bfloat16_row_decodes_the_same_in_a_batch_as_alone(engine_for, always_draft, method):
    """The left-padded prefill runs attention per row over the row's own tokens, so padding changes nothing."""
    model = low_precision("bfloat16")
    prompts = [[5, 17, 42], list(range(3, 120)) * 2, [1], list(range(50, 127))]   # 0 to 231 tokens of padding
    cfg = SamplingConfig(max_new_tokens=N)
    together = [r.token_ids for r in engine_for(method, model).generate(prompts, cfg)]
    alone = [engine_for(method, model).generate([p], cfg)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_bfloat16_rows_joining_a_running_batch_equal_alone(engine_for, always_draft, method):
    """The server's continuous batching in bfloat16: rows prefilled while others decode, their float64 caches
    merged, give what each prompt gives alone."""
    engine = engine_for(method, low_precision("bfloat16"))
    prompts = [[5, 17, 42], list(range(3, 120)) * 2, [1], list(range(50, 127))]
    cfgs = [SamplingConfig(max_new_tokens=n) for n in (20, 8, 16, 12)]
    alone = [engine.generate([p], c)[0].token_ids for p, c in zip(prompts, cfgs)]
    arrivals = {0: [(prompts[0], cfgs[0]), (prompts[1], cfgs[1])], 3: [(prompts[2], cfgs[2])],
                9: [(prompts[3], cfgs[3])]}
    tokens, _ = _run(Session(engine, cfgs[0]), arrivals)
    assert [tokens[r] for r in sorted(tokens)] == alone


def test_exact_attention_keeps_transformers_own_causal_masks():
    """A caller other than the engine (transformers' forward with a cache, several new tokens) hands the exact
    attention a boolean mask: it must stay a mask (a boolean taken as an additive 0 / 1 would let each new token
    see the ones after it)."""
    from transformers import DynamicCache
    model = low_precision("bfloat16")
    assert invariant.use_invariant_forms(model)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        cache = DynamicCache()
        model(ids[:, :4], past_key_values=cache)
        chunk = model(ids[:, 4:], past_key_values=cache).logits.float()         # 3 new tokens over a cache
        cache = DynamicCache()
        model(ids[:, :4], past_key_values=cache)
        alone = model(ids[:, 4:5], past_key_values=cache).logits.float()        # the first of them alone
    assert torch.equal(chunk[:, :1], alone)


def test_the_verify_cost_script_times_both_forms_and_refuses_bad_input(capsys):
    """scripts/verify_cost.py, which the README's counterpart figures come from: a median per width for the exact
    forms and the model's own kernels (a tiny bfloat16 model here); a bad --context is an error, not a traceback."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "verify_cost.py"
    spec = importlib.util.spec_from_file_location("verify_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for exact in (True, False):
        got = script.curve(tiny_llama(0).to(torch.bfloat16), exact, context=8, repeats=1)
        assert sorted(got) == list(script.WIDTHS) and all(s > 0 for s in got.values())
    assert script.main(["--context", "0"]) == 2 and "--context" in capsys.readouterr().err
