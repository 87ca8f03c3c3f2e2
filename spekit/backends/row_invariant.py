"""Row-invariant forms of a low-precision target's forward on a CPU, so that verification stays exact there.

Speculative decoding is lossless only if the target's logits for a token are the same whether it is computed
alone (a plain step) or as one row of a verification forward over a chain or tree of drafts. In float32 the
rounding differences between those shapes sit far below anything argmax or a sampler can see. In bfloat16 they
do not: a greedy answer computed in 8-token chunks drifts from the token-by-token one within tens of tokens,
through two kinds of kernels whose result for a row depends on the shape around it:

- a linear layer over one row may take a matrix-vector path that rounds differently from the matrix-matrix path
  of two or more rows on some CPUs (there one-row inputs are padded to two, which costs next to nothing where
  bfloat16 is native), while on CPUs that emulate bfloat16 one row is computed as the rows of wider products are,
  and padding would nearly double a plain step. So each weight shape is probed once per
  process (`one_row_invariant`: a row alone against the rows of wider products; a GEMM's summation order follows
  from the shapes, not the values) and padded only where the one-row path differs;
- attention: the fused kernels split keys and queries into blocks whose partial sums depend on the number of
  queries and keys. Attention here runs in float64 (SDPA's fused kernel on float64 q, k, v: products of bfloat16
  values are exact there, and blockings change sums by ~1e-16, far below a bfloat16 step), then is rounded back.
  The target's KV cache is kept in float64 (`STORE_DTYPE`, 4x the memory of bfloat16) so that no step converts
  it: converting the whole cache at every step would cost more than the attention itself.

What SDPA cannot do is written out in float64 as the model's own eager form does it: Gemma 2's logit
soft-capping and gpt-oss's attention sinks (slower, and only for those models).

A prompt's prefill is the same forward for every method, so it keeps the fused kernel (`bulk()`; the model's own
eager form where SDPA cannot do its attention): float64
attention over a 1000-token prompt would take seconds. In a left-padded batch the kernel runs per row over that
row's own tokens, so a row's prefill (and so its whole answer) is the same in any batch as alone.

With both, chained verification logits equal plain-step logits bit for bit (tests/test_invariant.py, and the
bundled model in bfloat16). Weight-only int8 / int4 layers (spekit.backends.weight_quant) are row-invariant already; a model
that has them keeps its float32 activations and gets the float64 attention. CUDA is left alone: its kernels are
not row-invariant either, and nothing here is measured there.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .fast_forward import gqa_sdpa
from .weight_quant import is_packed

_state = threading.local()


@contextlib.contextmanager
def bulk(pads: list[int] | None = None):
    """Within: attention takes the fused kernel (a left-padded prefill: identical for every method). pads: each
    row's count of left padding; the kernel then runs per row on its real tokens only, so that a row's prefill is
    the same computation in any batch as alone."""
    before = getattr(_state, "bulk", None)
    _state.bulk = list(pads or [])
    try:
        yield
    finally:
        _state.bulk = before


def _per_row(module, query, key, value, attention_mask, scaling, pads: list[int], **kwargs):
    """Fused attention of each row over its own tokens (the left padding cut off), zeros at padded queries.
    query [B, H, L, D], key/value [B, KVH, L, D] (a prefill: L new tokens, nothing cached), mask [B, 1, L, L]."""
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])     # [B, L, H, D]
    for b, pad in enumerate(pads):
        mask = None if attention_mask is None else attention_mask[b:b + 1, :, pad:, pad:]
        row, _ = _fused(module, query[b:b + 1, :, pad:], key[b:b + 1, :, pad:], value[b:b + 1, :, pad:], mask,
                        scaling=scaling, **kwargs)
        out[b:b + 1, pad:] = row
    return out, None


def _beyond_sdpa(module, kwargs: dict) -> bool:
    """The layer's attention does what SDPA cannot: Gemma 2's logit soft-capping, gpt-oss's sinks."""
    return kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None


def _fused(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """A prefill's attention in the model's dtype: the fused SDPA kernel, or, for what SDPA cannot do (Gemma 2's
    soft-capping, gpt-oss's sinks), the model's own eager form from its modeling module."""
    if _beyond_sdpa(module, kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return gqa_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


_ONE_ROW: dict[tuple, bool] = {}      # probed (weight shape, dtype, bias, device) -> one row rounds as the rest
PROBE_ROWS = (2, 3, 9)                 # the narrower products compared with the rows of the widest
# a differing summation order shows in a bfloat16 output only where the float32 sum sits near a rounding boundary
# (about one output in 10^4-10^5), so it takes this many rows, each also taken alone, to see it
PROBE_SAMPLES = 64


def one_row_invariant(weight: torch.Tensor, bias: torch.Tensor | None, linear=torch.nn.functional.linear) -> bool:
    """Whether this machine's kernels give a one-row product [1, in] bit for bit as the same row of wider products
    (PROBE_ROWS and PROBE_SAMPLES rows), and those the same rows as each other; probed once per shape and dtype."""
    key = (tuple(weight.shape), weight.dtype, bias is not None, weight.device.type)
    if key not in _ONE_ROW:
        g = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(PROBE_SAMPLES, weight.shape[1], generator=g, device=weight.device).to(weight.dtype)
        with torch.inference_mode():
            wide = linear(x, weight, bias)                                                   # [64, out]
            alone = all(torch.equal(linear(x[i:i + 1], weight, bias), wide[i:i + 1]) for i in range(len(x)))
            _ONE_ROW[key] = alone and all(torch.equal(linear(x[:m], weight, bias), wide[:m]) for m in PROBE_ROWS)
    return _ONE_ROW[key]


def _padded_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() != x.shape[-1]:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    two = torch.cat([x.reshape(1, -1), x.new_zeros(1, x.shape[-1])])    # [2, in]: the matrix-matrix path
    return torch.nn.functional.linear(two, self.weight, self.bias)[:1].reshape(*x.shape[:-1], -1)


def _exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    """query [B, H, N, D] in the model's dtype; key, value [B, KVH, S, D] (float64 from spekit's cache, see
    STORE_DTYPE; any dtype from another cache); attention_mask [B, 1, N, S] additive or None. Returns [B, N, H, D]
    in the query's dtype."""
    pads = getattr(_state, "bulk", None)
    if pads is not None:                        # the prefill: the fused kernel in the model's own dtype
        key, value = key.to(query.dtype), value.to(query.dtype)
        if len(pads) == query.shape[0] and key.shape[2] == query.shape[2]:
            return _per_row(module, query, key, value, attention_mask, scaling, pads, **kwargs)
        return _fused(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    n, keys = query.shape[2], key.shape[2]
    if attention_mask is not None:
        mask = attention_mask[..., :keys]
        mask = mask if mask.dtype == torch.bool else mask.double()     # transformers' own masks are boolean
    else:                                       # causal over the n new tokens at the end of the keys
        mask = torch.ones(n, keys, dtype=torch.bool, device=query.device).tril(keys - n)
    if _beyond_sdpa(module, kwargs):
        out = _written_out(module, query.double(), key.double(), value.double(), mask, scaling, kwargs.get("softcap"))
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.double(), key.double(), value.double(), attn_mask=mask, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _written_out(module, query, key, value, mask, scaling, softcap) -> torch.Tensor:
    """Attention with what SDPA cannot do, as the model's own eager form does it, in float64: Gemma 2's logit
    soft-capping (tanh(s / cap) * cap), gpt-oss's per-head sink logit (a column that takes probability and is
    dropped). query [B, H, N, D]; key, value [B, KVH, S, D]; mask [.., N, S] additive or bool. -> [B, H, N, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sinks = getattr(module, "sinks", None)
    if sinks is not None:                       # [H] -> a last column per head
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ value
    return scores.softmax(-1) @ value


EXACT = "spekit_exact"
STORE_DTYPE = torch.float64     # the target's KV cache under these forms: the attention reads it unconverted
AttentionInterface.register(EXACT, _exact_attention)
AttentionMaskInterface.register(EXACT, sdpa_mask)


def needed(model: torch.nn.Module) -> bool:
    """A CPU model whose forward is not float32 throughout: bfloat16 / float16 weights, or packed int8 / int4
    layers."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return False
    return param.dtype != torch.float32 or is_packed(model)


def use_invariant_forms(model: torch.nn.Module) -> bool:
    """Switch a low-precision CPU model (see `needed`) to the row-invariant forms above, in place (idempotent).
    Returns whether it applies."""
    if not needed(model):
        return False
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.forward.__func__ is not _padded_linear and \
                not one_row_invariant(module.weight, module.bias):
            module.forward = types.MethodType(_padded_linear, module)
    model.set_attn_implementation(EXACT)
    return True
