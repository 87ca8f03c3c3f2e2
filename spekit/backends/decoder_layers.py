"""Inside access to a causal LM's decoder stack, for methods that draft with the target's own layers (early exit,
layer skipping): embed, run a chosen subset of decoder layers, final norm, LM head. It calls the model's own
submodules (`embed_tokens`, `layers[i]`, `rotary_emb`, `norm`, `lm_head`) with a 4-D mask and explicit positions,
as the model's own forward does; no modeling code is copied. Re-applied by hand is what lives in the model's
forwards rather than in a submodule: Gemma's final logit soft-capping, Granite's embedding multiplier and logit
scaling.

A `Scratch` appends the draft's tokens to the chosen layers of the *target's* cache (so the draft reads the KV the
verification already computed for every committed token, and needs no cache of its own and no catch-up forward),
and takes them out again when it closes: the target's cache is left exactly as it was.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch

from ..cache import KVState, additive_mask, attention_mask
from ..config import UserError
from .torch_target import Target

# model types whose decoder layers take (hidden, attention_mask, position_embeddings, position_ids, cache), whose
# decoder has embed_tokens / layers / norm / rotary_emb, and whose forward does nothing else between them but what
# is re-applied here. Each is tested: the stack over every layer gives the model's own logits
# (tests/test_selfspec.py, tests/test_architectures.py).
SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "gemma2", "gemma3_text",
             "starcoder2", "smollm3", "granite", "granitemoe")


class Stack:
    def __init__(self, target: Target):
        model, config = target.model, target.config
        kind = getattr(config, "model_type", "?")
        decoder = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if kind not in SUPPORTED or decoder is None or not all(hasattr(decoder, p) for p in parts):
            raise UserError(f"drafting with the model's own layers supports {', '.join(SUPPORTED)}; this model is "
                            f"'{kind}'")
        self.target = target
        self.embed, self.layers, self.norm = decoder.embed_tokens, decoder.layers, decoder.norm
        self.rotary, self.head = decoder.rotary_emb, model.get_output_embeddings()
        self.num_layers = target.num_layers
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.rope_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.embed_scale = float(getattr(config, "embedding_multiplier", None) or 1.0)    # Granite's
        self.logit_scale = float(getattr(config, "logits_scaling", None) or 1.0)          # Granite's divisor

    def check_layers(self, layers: Sequence[int]) -> list[int]:
        """Sorted distinct layer ids, each in range."""
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad or not layers:
            raise UserError(f"layer ids must lie in 0..{self.num_layers - 1} (the model has {self.num_layers} "
                            f"layers), got {list(layers)}")
        return sorted(set(layers))

    def relative_cost(self, layers: Sequence[int]) -> float:
        """A one-token forward through `layers`, the norm and the head, relative to one through the whole model,
        by the weights each reads (a one-token forward is memory-bound)."""
        size = [sum(p.numel() for p in layer.parameters()) for layer in self.layers]
        head = self.head.weight.numel()
        return (sum(size[i] for i in layers) + head) / (sum(size) + head)

    def hidden(self, cache, tokens: torch.Tensor, positions: torch.Tensor, mask, layers: Sequence[int]) -> torch.Tensor:
        """Embed tokens [B, N] and run them through `layers` (in order), appending their KV to `cache` for those
        layers. positions: [B, N] long (-1 = padding); mask: [B, 1, N, S+N] additive, or a dict by layer type.
        Returns the last hidden state [B, N, H], before the final norm."""
        pos = positions.clamp(min=0)
        h = self.embed(tokens)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        if self.rope_by_type:
            rope = {t: self.rotary(h, pos, t) for t in {self.layer_types[i] for i in layers}}
        else:
            rope = dict.fromkeys(set(self.layer_types), self.rotary(h, pos))
        for i in layers:
            kind = self.layer_types[i]
            h = self.layers[i](h, attention_mask=mask[kind] if isinstance(mask, dict) else mask,
                               position_embeddings=rope[kind], position_ids=pos, cache=cache, use_cache=True)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [B, N, H] -> [B, N, V]."""
        out = self.head(self.norm(hidden))
        if self.logit_scale != 1.0:
            out = out / self.logit_scale
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    @torch.inference_mode()
    def forward(self, kv: KVState, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                layers: Sequence[int] | None = None) -> torch.Tensor:
        """Like Target.forward over `layers` (default: all), in a cache of its own: logits [B, N, V]."""
        layers = range(self.num_layers) if layers is None else layers
        out = self.hidden(kv.cache, tokens, positions, kv.attention_mask(positions, tree_mask), layers)
        kv.appended(positions)
        return self.logits(out)


class Scratch:
    """Draft tokens run through `layers` on top of the target's cache `kv`, taken out again by `close`."""

    def __init__(self, stack: Stack, kv: KVState, layers: Sequence[int], adapter=None):
        """adapter: a module applied to the last hidden state before the final norm (an exit adapter), or None."""
        self.stack, self.kv, self.layers, self.adapter = stack, kv, list(layers), adapter
        self.pos = kv.slot_pos[:, :0]                                           # [B, T] positions appended so far

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
             allowed: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [B, N]; tree_mask: [B, N, N] among the new tokens (the cache and earlier draft tokens
        are all visible to them, unless `allowed` [B, N, S+T+N] says what each may see). Returns the draft's
        logits [B, N, V]."""
        slots = torch.cat([self.kv.slot_pos, self.pos], dim=1)
        if allowed is None:
            mask = attention_mask(slots, positions, tree_mask, self.kv.dtype, self.kv.sliding_window)
        else:
            mask = additive_mask(allowed, torch.cat([slots, positions], dim=1), positions, self.kv.dtype,
                                 self.kv.sliding_window)
        out = self.stack.hidden(self.kv.cache, tokens, positions, mask, self.layers)
        self.pos = torch.cat([self.pos, positions], dim=1)
        return self.stack.logits(out if self.adapter is None else self.adapter(out))

    def close(self) -> None:
        appended = self.pos.shape[1]
        if appended:
            for i in self.layers:
                self.kv.cache.layers[i].crop(-appended)
        self.pos = self.kv.slot_pos[:, :0]
