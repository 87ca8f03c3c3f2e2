"""Export Medusa heads to the layout vLLM loads (`vllm/model_executor/models/medusa.py`), and read such an export
back into spekit.

vLLM's layout: config.json with `model_type: "medusa"`, `num_heads`, `num_hidden_layers` (residual layers per
head), `hidden_size`, `vocab_size`, `truncated_vocab_size` (with a `token_map` tensor when the heads' vocabulary
is reduced), `original_lm_head` (one LM head shared by all heads) and `medusa_fc_bias`; weights
`blocks.{h}.layers.{l}.weight|bias` and `lm_heads.{h}.weight` (with original_lm_head only `lm_heads.0.weight`, a
copy of the target's LM head, since vLLM's Medusa model holds its own). SGLang has no Medusa drafter.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import UserError
from . import load_head, read_config
from .base import check_out, write_dir
from .medusa import MedusaConfig, MedusaHead, target_lm_weight


def export_medusa(head_dir: str | Path, out_dir: str | Path, engine: str, target=None,
                  model: str | None = None) -> Path:
    """Write the Medusa heads in `head_dir` as a checkpoint `engine` loads. target (spekit.backends.torch_target.Target): the
    model the heads were trained for, needed for its LM head when the heads share it; else `model` (a name or
    path) is loaded, by default the one the heads were trained with (meta "target")."""
    if engine == "sglang":
        raise UserError("SGLang does not load Medusa heads (its speculative decoding takes EAGLE, EAGLE-3, MTP "
                        "and draft models); export them with --to vllm, or train EAGLE heads for SGLang")
    if engine != "vllm":
        raise UserError(f"unknown engine {engine!r}; Medusa heads export to: vllm")
    info = read_config(head_dir)
    if info["kind"] != "medusa":
        raise UserError(f"{head_dir} holds a '{info['kind']}' head, not Medusa heads")
    check_out(out_dir, "export", source=head_dir)
    if target is None:      # the model's LM head only when the heads share it; else the heads alone
        from .base import TargetShell
        shared = info["config"].get("share_lm_head", MedusaConfig.share_lm_head)
        target = _load_target(info, model) if shared else TargetShell(info["target"])
    head = load_head(head_dir, target, kind="medusa")
    cfg: MedusaConfig = head.config
    dtype = load_file(str(Path(head_dir) / "model.safetensors"))["blocks.0.layers.0.weight"].dtype
    tensors = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in head.state_dict().items()}
    if cfg.share_lm_head:
        tensors["lm_heads.0.weight"] = target_lm_weight(target).detach().to(dtype)
    vocab = info["target"]["vocab_size"]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": info["target"]["hidden_size"],
              "vocab_size": vocab, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "truncated_vocab_size": cfg.draft_vocab or vocab, "original_lm_head": cfg.share_lm_head,
              "medusa_fc_bias": True, "max_paths": len(getattr(head, "meta", {}).get("tree") or []) or 64,
              "topk": 10, "torch_dtype": str(dtype).replace("torch.", ""),
              "spekit": {"kind": "medusa", "target": info["target"], "meta": getattr(head, "meta", {})}}
    return write_dir(out_dir, tensors, config)


def read_vllm_medusa(directory: str | Path, target) -> MedusaHead:
    """A vLLM Medusa checkpoint as spekit heads for `target` (the LM head of an original_lm_head export is the
    target's own, so it is not read)."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
        state = load_file(str(directory / "model.safetensors"))
    except (OSError, ValueError, SafetensorError) as err:
        raise UserError(f"{directory} is not a readable vLLM Medusa checkpoint ({err})") from None
    if not isinstance(config, dict) or config.get("model_type") != "medusa":
        raise UserError(f"{directory} is not a Medusa checkpoint (model_type "
                        f"{config.get('model_type') if isinstance(config, dict) else None!r})")
    vocab = config["vocab_size"]
    if vocab != target.vocab_size or config["hidden_size"] != int(target.config.hidden_size):
        raise UserError(f"{directory} was made for another model (vocab {vocab}, hidden {config['hidden_size']})")
    truncated = config.get("truncated_vocab_size") or vocab
    shared = bool(config.get("original_lm_head", False))
    cfg = MedusaConfig(num_heads=config["num_heads"], num_layers=config["num_hidden_layers"], share_lm_head=shared,
                       draft_vocab=truncated if truncated < vocab else 0)
    target_config = dict(config.get("spekit", {}).get("target") or {})
    target_config.update(vocab_size=vocab, hidden_size=config["hidden_size"], num_layers=target.num_layers)
    head = MedusaHead(cfg, target_config)
    if shared:
        state.pop("lm_heads.0.weight", None)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{directory} does not fit Medusa heads (missing {missing[:3]}, unexpected {unexpected[:3]})")
    head.meta = config.get("spekit", {}).get("meta", {})
    return head.float().eval()


def _load_target(info: dict, model: str | None):
    from ..backends.torch_models import load_model
    from ..backends.torch_target import Target
    name = model or info["meta"].get("target") or info["meta"].get("model")
    if not name:
        raise UserError("these heads share the target's LM head, and their config names no model to take it "
                        "from; pass the target model with --model")
    return Target(load_model(name).model, fast=False)
