"""`spekit export DIR --to vllm|sglang|speculators --out OUT`: write a trained head directory in the layout a
serving engine loads (`config.json` + `model.safetensors`), and read such a layout back into a spekit head
(`--to speculators`: EAGLE-3 and MTP in the speculators format, see spekit.heads.speculators).

Exporters are registered by head kind (`@exporter("eagle")`); each returns the tensors and config of one engine
layout, and an importer (`@importer("LlamaForCausalLMEagle")`, by the exported architecture) rebuilds the head.

- eagle  -> `LlamaForCausalLMEagle`: `fc.weight` [H, 2H] over cat(embedding, feature), `layers.0.*` (no
  input_layernorm, as EAGLE-1 has none). spekit's features are the target's last hidden state after the final
  norm (Hugging Face's last `hidden_states` entry); vLLM and SGLang pass EAGLE-1 heads the state before it, so an
  exported EAGLE-1 head accepts less there than in spekit. vLLM and SGLang read the same layout.
- eagle3 -> `LlamaForCausalLMEagle3`: `fc.weight` [H, 3H], `midlayer.*` (q/k/v over 2H, `hidden_norm`), `norm`,
  `lm_head` [Vd, H], `d2t` [Vd] offsets (target id = draft id + d2t[draft id]), `t2d` [V] bool; the config names
  `draft_vocab_size` and the fused layers (`eagle_config.eagle_aux_hidden_state_layer_ids`, Hugging Face
  hidden_states numbering, which is also vLLM's). vLLM and SGLang read the same layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import UserError
from . import HEADS, Head, load_head, target_info
from .base import TargetShell, check_out, write_dir
from .eagle import rope_parameters

ENGINES = ("vllm", "sglang", "speculators")
EXPORTERS: dict[str, Callable[[Head, str], tuple[dict, dict]]] = {}
IMPORTERS: dict[str, Callable[[dict, dict, object], Head]] = {}


def exporter(kind: str):
    def add(fn):
        EXPORTERS[kind] = fn
        return fn
    return add


def importer(architecture: str):
    def add(fn):
        IMPORTERS[architecture] = fn
        return fn
    return add


def _export_medusa(head_dir, out, to: str, info: dict, model: str | None) -> Path:
    from .export_medusa import export_medusa
    return export_medusa(head_dir, out, to, model=model)


def _export_mtp(head_dir, out, to: str, info: dict, model: str | None) -> Path:
    """MTP modules go out as the whole model with its modules appended in the DeepSeek-V3 layout (layers
    num_hidden_layers + k, `num_nextn_predict_layers`): the form both engines' MTP drafters read."""
    from .mtp_native import export_mtp
    model = model or info["meta"].get("target") or info["target"].get("name") or "smollm2-135m"
    return export_mtp(head_dir, out, model=model)


# Kinds whose export needs more than the head (the target's LM head, or the whole model): the function writes
# the output directory itself.
WHOLE_EXPORTERS: dict[str, Callable] = {"medusa": _export_medusa, "mtp": _export_mtp}


def export(head_dir: str | Path, to: str, out: str | Path, model: str | None = None) -> Path:
    """Write the head in `head_dir` in engine `to`'s layout into `out` (atomically). Returns out. model: the target
    model, for kinds whose export holds some of it (default: the one recorded when the head was trained)."""
    if to not in ENGINES:
        raise UserError(f"--to must be one of {', '.join(ENGINES)}, got {to!r}")
    if to == "speculators":             # EAGLE-3 / MTP in the speculators format (vllm serve DIR)
        from .speculators import export_speculators
        return export_speculators(head_dir, out, model)
    from . import read_config
    info = read_config(head_dir)
    check_out(out, "export", source=head_dir)
    if info["kind"] in WHOLE_EXPORTERS:
        return WHOLE_EXPORTERS[info["kind"]](head_dir, out, to, info, model)
    if info["kind"] not in EXPORTERS:
        kinds = ", ".join(sorted({*EXPORTERS, *WHOLE_EXPORTERS}))
        raise UserError(f"no exporter for '{info['kind']}' heads; exportable: {kinds}")
    head = load_head(head_dir, TargetShell(info["target"]))
    tensors, config = EXPORTERS[info["kind"]](head, to)
    config["spekit"] = {"kind": info["kind"], "target": info["target"], "meta": info["meta"]}
    return write_dir(out, tensors, config)


def load_export(directory: str | Path, target) -> Head:
    """Read an exported layout back into a spekit head for `target` (spekit.backends.torch_target.Target)."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
        tensors = load_file(str(directory / "model.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError) as err:
        raise UserError(f"{directory} is not a readable export ({err})") from None
    arch = (config.get("architectures") or [""])[0]
    if arch not in IMPORTERS:
        raise UserError(f"{directory}: unknown architecture {arch!r}; known: {', '.join(sorted(IMPORTERS))}")
    head = IMPORTERS[arch](config, tensors, target)
    return head.to(device=target.device).eval()


def _llama_config(head: Head, architecture: str) -> dict:
    c = head.config
    return {"architectures": [architecture], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": head.target_config["vocab_size"],
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bias": bool(getattr(c, "fc_bias", False)),
            **({"rope_scaling": rope_parameters(c)} if c.rope_scaling else {})}


def _shape_of(config: dict) -> dict:
    from .published import layer_shape
    return layer_shape(config, "the export's config.json")


def _fill(head: Head, state: dict, directory_hint: str) -> Head:
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"the export does not fit a '{head.kind}' head (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}) {directory_hint}")
    return head


@exporter("eagle")
def _export_eagle(head: Head, to: str) -> tuple[dict, dict]:
    state = head.state_dict()
    tensors = {k: state[k] for k in ("fc.weight", "fc.bias") if k in state}
    tensors.update({"layers.0." + k[len("layer."):]: v for k, v in state.items() if k.startswith("layer.")})
    return {k: v.to(torch.bfloat16) for k, v in tensors.items()}, _llama_config(head, "LlamaForCausalLMEagle")


@importer("LlamaForCausalLMEagle")
def _import_eagle(config: dict, tensors: dict, target) -> Head:
    cls = HEADS["eagle"]
    head = cls(cls.Config(**_shape_of(config), fc_bias="fc.bias" in tensors), target_info(target))
    state = {("layer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    return _fill(head, {k: v.float() for k, v in state.items()}, "(LlamaForCausalLMEagle)")


@exporter("eagle3")
def _export_eagle3(head: Head, to: str) -> tuple[dict, dict]:
    tensors = {k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16)) for k, v in head.state_dict().items()}
    config = _llama_config(head, "LlamaForCausalLMEagle3")
    config["draft_vocab_size"] = head.config.draft_vocab_size
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": head.feature_layers()}
    return tensors, config


@importer("LlamaForCausalLMEagle3")
def _import_eagle3(config: dict, tensors: dict, target) -> Head:
    cls = HEADS["eagle3"]
    layers = tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ())
    head = cls(cls.Config(**_shape_of(config), draft_vocab_size=int(config["draft_vocab_size"]), layers=layers),
               target_info(target))
    state = {k: (v if k in ("d2t", "t2d") else v.float()) for k, v in tensors.items()}
    return _fill(head, state, "(LlamaForCausalLMEagle3)")


