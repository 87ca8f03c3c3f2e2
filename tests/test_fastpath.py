"""The fast CPU forms compute the same function as transformers' own (to float32 rounding)."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spekit.backends.fast_forward import use_fast_linear, use_gqa_attention


@pytest.mark.parametrize("rows", [1, 2, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    fast = copy.deepcopy(layer)
    assert use_fast_linear(fast) == 1 and use_fast_linear(fast) == 0          # idempotent
    x = torch.randn(1, rows, 48)
    torch.testing.assert_close(fast(x), layer(x), rtol=1e-5, atol=1e-5)
    assert fast(x).is_contiguous()


def test_fast_model_gives_the_same_logits_with_a_cache():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    stock = LlamaForCausalLM(config).eval()
    fast = copy.deepcopy(stock)
    use_fast_linear(fast)
    assert use_gqa_attention(fast)
    ids = torch.randint(0, 96, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-5)
        mask = torch.zeros(2, 1, 12, 12).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), -1e30)
        torch.testing.assert_close(fast(ids, attention_mask=mask).logits, stock(ids).logits, rtol=1e-4, atol=1e-5)
