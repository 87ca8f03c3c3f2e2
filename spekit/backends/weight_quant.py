"""Weight-only int8 / int4 linear layers on PyTorch's own packed CPU kernels, for an inference model.

transformers dequantizes a GGUF fully on load; this packs the weights again, per output channel (int8) or per
group of 32 input features with a scale and a minimum (int4, the layout of GGUF's Q4_1). The LM head is int8 in
both (GGUF files keep the output / tied embedding matrix at 8 bits: the bundled SmolLM2 has Q4_1 layers and a
Q8_0 embedding, so `int4` comes back to nearly the file's own values, while int8's per-channel grid re-rounds
them; `python scripts/quant_accuracy.py` measures both against float32, docs/USAGE.md has the figures). The kernels
(`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`, the ones torchao and gpt-fast call) take
bfloat16 activations (with float32 ones they run a slow reference path); the rest of the model keeps its dtype.
Each output row depends on its input row alone (a row is computed the same in a batch of 1 or 8), which keeps a
speculative step's verification consistent with a plain step. The kernels are called directly because torchao's
weight-only int8 layer dequantizes on every call unless compiled and it has no int4 CPU packing.
"""
from __future__ import annotations

import torch

from ..config import UserError

SCHEMES = ("none", "int8", "int4")
GROUP = 32


class PackedLinear(torch.nn.Module):
    """A bias-optional linear layer y = x W^T + b with W stored packed (int8 per channel or int4 per group)."""

    def __init__(self, linear: torch.nn.Linear, bits: int, group: int = GROUP, keep_weight: bool = False):
        """keep_weight: keep the unpacked weight as `weight` too (the LM head, whose weight is the tied input
        embedding anyway, and which drafting heads read)."""
        super().__init__()
        if keep_weight:
            self.weight = linear.weight
        weight = linear.weight.detach().float()                             # [out, in]
        self.in_features, self.out_features, self.bits, self.group = weight.shape[1], weight.shape[0], bits, group
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), False)
        if bits == 8:
            scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-8)        # [out]
            self.register_buffer("packed", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale.bfloat16())
        else:
            self.register_buffer("packed", None)
            self.register_buffer("scales", None)
            self.packed, self.scales = _pack_int4(weight, group)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [R, in] bf16 -> [R, out] bf16, without the bias."""
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(flat, self.packed, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous())    # [R, out]
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight these packed values stand for, [out, in] float32 (for accuracy checks)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self._product(eye).float().t()


def is_packed(model: torch.nn.Module) -> bool:
    """Whether `quantize` packed any of the model's linear layers."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def packed_bits(model: torch.nn.Module) -> list[int]:
    """The bit widths of the model's packed linear layers, sorted ([] where `quantize` packed none)."""
    return sorted({m.bits for m in model.modules() if isinstance(m, PackedLinear)})


def _pack_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (packed int4 weight, scales-and-zeros [in/group, out, 2] bf16), asymmetric per group:
    w = q * scale + minimum, q in 0..15 (the kernel computes (q - 8) * scale + zero)."""
    out, inp = weight.shape
    grouped = weight.reshape(out, inp // group, group)                      # [out, G, group]
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
    zero = low + 8 * scale
    scales = torch.stack([scale.reshape(out, -1).t(), zero.reshape(out, -1).t()], dim=-1)   # [G, out, 2]
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales.contiguous().bfloat16()


def quantize(model: torch.nn.Module, scheme: str) -> int:
    """Replace every nn.Linear of the model (the LM head too, always int8, as GGUF files keep their output and
    embedding matrix at 8 bits or more; embeddings stay) by a PackedLinear, in place. The
    rest of the model keeps its dtype: in float32, norms, residuals, attention and the KV cache stay float32
    (torch's bfloat16 CPU attention for one query is 6x slower than float32's). Returns how many layers were packed. "none" does nothing."""
    if scheme not in SCHEMES:
        raise UserError(f"quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme == "none":
        return 0
    if next(model.parameters()).device.type != "cpu":
        raise UserError(f"--quantize {scheme} runs on PyTorch's CPU kernels; on a GPU use --dtype bfloat16")
    bits = 8 if scheme == "int8" else 4
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for name, linear in targets:
        if bits == 4 and linear.in_features % GROUP:
            raise UserError(f"int4 needs in_features divisible by {GROUP}; {name} has {linear.in_features}")
    head = model.get_output_embeddings()
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        packed = PackedLinear(linear, 8 if linear is head else bits, keep_weight=linear is head)
        setattr(model.get_submodule(parent) if parent else model, child, packed)
    return len(targets)
