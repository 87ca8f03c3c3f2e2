"""The fast target path keeps every guarantee:

- the slot cache: a crop costs nothing and the next forward overwrites the dropped slots; a batch with ragged
  acceptance over many steps attends exactly what a fresh prefill of each row's kept tokens would;
- weight-only int8 / int4: the packed layers compute the product with the weights they stand for; every lossless
  method over a quantized target reproduces that target's own plain greedy output;
- torch.compile: the compiled forward gives the same tokens as the eager one.
"""
from __future__ import annotations

import copy

import pytest
import torch

from spekit import proposers
from spekit.cache import SlotLayer
from spekit.engine import Engine
from spekit.config import SamplingConfig, UserError
from spekit.backends.weight_quant import PackedLinear, quantize
from spekit.backends.torch_target import Target

from conftest import make_engine, plain_greedy_hf, tiny_llama


def test_slot_layer_crops_without_copying_and_overwrites():
    layer = SlotLayer(capacity=8)
    k = torch.arange(4.0).reshape(1, 1, 4, 1)
    keys, _ = layer.update(k, k + 100)
    buffer = layer._keys
    assert keys.shape == (1, 1, 4, 1) and layer.get_seq_length() == 4
    layer.crop(-2)
    assert layer.keys.flatten().tolist() == [0, 1]
    keys, values = layer.update(torch.full((1, 1, 3, 1), 7.0), torch.full((1, 1, 3, 1), 8.0))
    assert layer._keys is buffer                                        # same buffer: nothing reallocated
    assert keys.flatten().tolist() == [0, 1, 7, 7, 7] and values.flatten().tolist() == [100, 101, 8, 8, 8]
    layer.update(torch.ones(1, 1, 9, 1), torch.ones(1, 1, 9, 1))        # beyond the reserve: grows, keeps content
    assert layer.get_seq_length() == 14 and layer.keys.flatten()[:5].tolist() == [0, 1, 7, 7, 7]


@torch.inference_mode()
def test_ragged_acceptance_keeps_the_cache_consistent():
    """Many steps of a 3-row batch where each row keeps a different random part of a random tree-shaped draft
    (and the cache compacts its holes on the way): the logits of one more token equal those over a fresh prefill
    of each row's kept tokens."""
    torch.manual_seed(0)
    target = Target(tiny_llama(3))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
    kv = target.new_state(3)
    kv.reserve(16)                                                      # small: the run must outgrow it
    target.prefill(kv, prompts)
    kept = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(1)
    for step in range(25):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        tokens = torch.randint(0, 128, (3, n), generator=gen)
        start = kv.length
        positions = kv.next_positions()[:, None] + torch.arange(n)[None]
        target.forward(kv, tokens, positions, torch.ones(n, n, dtype=torch.bool).tril().expand(3, n, n))
        counts = torch.randint(0, n + 1, (3,), generator=gen)           # a chain: keep its first counts[b]
        m = int(counts.max())
        kv.keep(start, torch.arange(m).expand(3, m), counts)
        for b in range(3):
            kept[b] += tokens[b, :int(counts[b])].tolist()
        if step % 7 == 6:
            kv.compact(slack=0)
    probe = torch.tensor([[1], [2], [3]])
    logits, _ = target.forward(kv, probe, kv.next_positions()[:, None], torch.ones(3, 1, 1, dtype=torch.bool))
    for b in range(3):
        fresh = target.new_state(1)
        target.prefill(fresh, [kept[b]])
        ref, _ = target.forward(fresh, probe[b:b + 1], torch.tensor([[len(kept[b])]]),
                                torch.ones(1, 1, 1, dtype=torch.bool))
        torch.testing.assert_close(logits[b], ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_packed_linear_is_the_product_with_its_weights(scheme, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=True)
    packed = PackedLinear(layer, 8 if scheme == "int8" else 4)
    weight = packed.dequantized()                                       # [96, 64] what the packed values mean
    assert (weight - layer.weight).abs().max() < (0.02 if scheme == "int8" else 0.1)
    x = torch.randn(2, rows, 64)
    ref = torch.nn.functional.linear(x.bfloat16().float(), weight, layer.bias)
    torch.testing.assert_close(packed(x), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(packed(x[:, :1]), packed(x)[:, :1])              # a row does not depend on its batch


def test_int4_keeps_weights_already_on_its_grid():
    """Weights that are q * scale + min per group of 32 (what a Q4_1 GGUF dequantizes to; magnitudes of a real
    model's) come back to their own grid points: off by far less than a grid step (bfloat16 scales)."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 64)).float()
    q[:, ::32], q[:, 31::32] = 0, 15                                    # every group spans its full range
    scale, low = torch.rand(32, 2, 1) * 0.01 + 0.002, torch.randn(32, 2, 1) * 0.05
    weight = (q.reshape(32, 2, 32) * scale + low).reshape(32, 64)
    layer = torch.nn.Linear(64, 32, bias=False)
    layer.weight.data = weight
    error = (PackedLinear(layer, 4).dequantized() - weight).abs().reshape(32, 2, 32)
    assert (error / scale).max() < 0.25


def test_quantize_rejects_what_it_cannot_pack():
    with pytest.raises(UserError, match="quantize must be one of"):
        quantize(tiny_llama(0), "int3")
    odd = torch.nn.Sequential(torch.nn.Linear(40, 8))
    with pytest.raises(UserError, match="divisible by 32"):
        quantize(odd, "int4")
    assert quantize(tiny_llama(0), "none") == 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("method,draft", [("plain", None), ("ngram", None), ("draft", "self"), ("lookahead", None),
                                          ("jacobi", None)])
def test_every_method_reproduces_the_quantized_targets_greedy(scheme, method, draft):
    model = tiny_llama(1, logit_scale=4.0)
    assert quantize(model, scheme) == 2 * 7 + 1                         # 7 linears per layer and the LM head
    assert model.lm_head.bits == 8
    prompt = [7, 8, 9, 10] * 4
    want = plain_greedy_hf(model, prompt, 20)
    engine = make_engine(method, model, copy.deepcopy(model) if draft else None)
    [r] = engine.generate([prompt], SamplingConfig(max_new_tokens=20))
    assert r.token_ids == want


def test_compiled_forward_gives_the_eager_tokens():
    """Two graphs get compiled (one new token; several); a speculative method goes through both."""
    model = tiny_llama(2, logit_scale=4.0)
    prompt = [3, 4, 5, 6] * 4
    want = plain_greedy_hf(model, prompt, 16)
    target = Target(model, compile=True)
    for method in ("plain", "ngram"):
        cls = proposers.get(method)
        engine = Engine(target, cls(target, cls.Options(), None))
        [r] = engine.generate([prompt], SamplingConfig(max_new_tokens=16))
        assert r.token_ids == want, method
