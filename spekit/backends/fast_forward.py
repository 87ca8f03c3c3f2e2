"""The target's forward in the forms this CPU runs fastest, for a model used only for inference, without
copying modeling code: linear layers through a faster BLAS call, and attention through torch's SDPA with native
grouped-query support (transformers repeats K and V for every query head when it is given a mask).

What each form is for (`python scripts/verify_cost.py` measures a forward over 1-32 new tokens in both):

- One row: MKL's matrix-vector path runs on one thread; padding the row to two and taking W @ x^T uses both
  cores and costs less than the one-row call.
- A few rows: W @ x^T with row-major operands avoids repacking W on every call; the result is made row-major
  again, or SDPA falls back to its slow math kernel.
- More than SMALL rows (prefill) keep nn.Linear.
- Attention: SDPA with enable_gqa reads K and V once instead of transformers' repeated copies.
Verifying a 1-token draft then costs what a plain step costs, which is what speculative decoding needs. Only for
float32 on a CPU (bf16 goes through oneDNN, where nn.Linear is already good). The arithmetic is the same matrix
product, so results agree with nn.Linear to float32 rounding (the tests compare outputs token for token).
"""
from __future__ import annotations

import types

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SMALL = 32   # up to this many rows (decoding and verification) take the fast form; prefill keeps nn.Linear


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])                                  # [R, in]
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])      # [2, in]: MKL's 1-row path is slower
    y = torch.mm(self.weight, flat.contiguous().t()).t()[:rows].contiguous()   # [R, out], row-major
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def applies(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32


def use_fast_linear(model: torch.nn.Module) -> int:
    """Switch every nn.Linear of an inference model to the fast forms above (in place; idempotent). Returns how
    many layers were switched; 0 where it does not apply (not float32 on a CPU)."""
    if not applies(model):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.forward.__func__ is not _forward:
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """query [B, H, N, D]; key, value [B, KVH, S, D]; attention_mask [B, 1, N, S] additive, from spekit's cache.
    Without a mask (a caller other than spekit) it is transformers' own SDPA path."""
    if attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None                        # [B, N, H, D]


GQA_SDPA = "spekit_gqa_sdpa"
AttentionInterface.register(GQA_SDPA, gqa_sdpa)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """On a CPU, switch a model that uses transformers' SDPA attention to the GQA-native form (in place).
    Returns whether it switched. (On CUDA a mask with GQA sends SDPA to its slow math kernel: left alone.)"""
    param = next(model.parameters())
    if param.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(GQA_SDPA)
    return True
