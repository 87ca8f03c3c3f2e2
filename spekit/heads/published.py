"""Drafters published in the ecosystem's formats, read as spekit heads: `load_head` (and so `--heads DIR` of every
method that drafts with trained heads) comes here for any folder that is not spekit's own layout.

Layouts tried, in this order (`LAYOUTS`):
- speculators (`config.json` with `speculators_model_type`; the format `vllm serve DIR` runs): EAGLE-3 and MTP
  drafters, see spekit.heads.speculators;
- `LlamaForCausalLMEagle3`: the EAGLE repository's EAGLE-3 checkpoints as SGLang loads them (`midlayer.*`, `fc`
  [H, 3H], `d2t`/`t2d`), and spekit's own export to vLLM / SGLang;
- EAGLE-1: `LlamaForCausalLMEagle` (spekit's export), or the EAGLE repository's checkpoints (architecture
  `LlamaForCausalLM` with `fc.weight` [H, 2H], optional `fc.bias`, `layers.0.*` and no `model.layers.*`); their
  features are the target's last hidden state after the final norm, as spekit's;
- Medusa: FasterDecoding's `medusa_lm_head` (config `medusa_num_heads`, tensors `{head}.{layer}.linear.*` and
  `{head}.{num_layers}.weight`), or vLLM's `MedusaModel` (spekit.heads.export_medusa);
- a DeepSeek-V3-style checkpoint whose config declares MTP layers (`num_nextn_predict_layers`): its layers
  num_hidden_layers .. + n - 1 (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the decoder block's own names).

Every importer checks the recorded shapes against the target and names the mismatch; tensors a drafter keeps that
spekit takes from the target instead (the token embedding, a shared LM head) must equal the target's.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import UserError
from .base import HEADS, OTHER_LAYOUTS, Head, target_info

LAYOUTS = ("spekit head (config.json with kind/config/target)", "speculators (speculators_model_type eagle3, mtp)",
           "EAGLE-3 (LlamaForCausalLMEagle3)", "EAGLE-1 (LlamaForCausalLMEagle, or fc + layers.0 from the EAGLE "
           "repository)", "Medusa (FasterDecoding medusa_lm_head, vLLM MedusaModel)",
           "DeepSeek-V3 MTP layers (num_nextn_predict_layers)")


def read_tensors(directory: Path, names: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: `names` (files tried first, e.g. medusa_lm_head.safetensors), else every
    *.safetensors, else pytorch_model.bin (read with weights_only). UserError when none or one is unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    files = [directory / n for n in names if (directory / n).is_file()] or sorted(directory.glob("*.safetensors"))
    if not files:
        files = [f for f in (directory / "pytorch_model.bin", directory / "medusa_lm_head.pt") if f.is_file()]
    if not files:
        raise UserError(f"{directory} holds no weights (*.safetensors or pytorch_model.bin)")
    tensors = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)) if file.suffix == ".safetensors"
                           else torch.load(str(file), map_location="cpu", weights_only=True))
        except (SafetensorError, OSError, ValueError, RuntimeError, EOFError) as err:
            raise UserError(f"{file} cannot be read ({str(err)[:200]}); the file is corrupt or truncated") from None
    return tensors


def layer_shape(config: dict, where: str) -> dict:
    """A Llama-style decoder layer's dimensions (spekit.heads.eagle.LayerShape fields) from a Hugging Face config
    dict; the usual defaults where a published config leaves a field out."""
    try:
        h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
        if "type" in rope:                                  # older configs' name for rope_type
            rope.setdefault("rope_type", rope.pop("type"))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        return dict(hidden_size=h, intermediate_size=int(config["intermediate_size"]), num_attention_heads=heads,
                    num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                    head_dim=int(config.get("head_dim") or h // heads),
                    rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6), rope_theta=theta,
                    max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
                    rope_scaling=json.dumps(rope, sort_keys=True) if rope else "")
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{where}: the decoder layer's config lacks or garbles {err}") from None


def check_target(directory, target, hidden: int | None = None, vocab: int | None = None, layers=(),
                 what: str = "drafter") -> None:
    """UserError naming the mismatch unless the drafter's hidden size, vocabulary and fused layer ids fit."""
    info = target_info(target)
    if hidden is not None and int(hidden) != info["hidden_size"]:
        raise UserError(f"{directory}: this {what} was made for hidden size {hidden}, this model has "
                        f"{info['hidden_size']}")
    if vocab is not None and int(vocab) != info["vocab_size"]:
        raise UserError(f"{directory}: this {what} was made for a vocabulary of {vocab} tokens, this model has "
                        f"{info['vocab_size']}")
    bad = [i for i in layers if not 0 <= int(i) <= info["num_layers"]]
    if bad:
        raise UserError(f"{directory}: this {what} reads the target's hidden states after layers {list(layers)}; "
                        f"{bad} are out of range for this model's {info['num_layers']} layers "
                        f"(0..{info['num_layers']})")


def check_same(directory, name: str, weight: torch.Tensor, own: torch.Tensor, what: str) -> None:
    """A tensor the drafter carries that spekit takes from the target must equal the target's (fp32 tolerance 1e-3,
    above bf16 rounding of the same weights)."""
    own = own.detach().float().cpu()
    if tuple(weight.shape) != tuple(own.shape):
        raise UserError(f"{directory}: {name} has shape {list(weight.shape)}, this model's {what} is "
                        f"{list(own.shape)}")
    if not torch.allclose(weight.float(), own, atol=1e-3 * (1 + own.abs().max().item()), rtol=1e-2):
        raise UserError(f"{directory}: {name} differs from this model's {what} (the drafter was trained with "
                        f"another one); spekit drafts with the model's own")


def fill(head: Head, state: dict[str, torch.Tensor], directory, layout: str) -> Head:
    """Load `state` into `head`, naming the first shape mismatch, missing or unexpected tensor."""
    own = head.state_dict()
    for name, value in state.items():
        if name in own and tuple(own[name].shape) != tuple(value.shape):
            raise UserError(f"{directory} ({layout}): {name} has shape {list(value.shape)}, this model needs "
                            f"{list(own[name].shape)}")
    missing, unexpected = head.load_state_dict(
        {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise UserError(f"{directory} does not fit a '{head.kind}' head as {layout} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    return head


def detect(directory: Path) -> tuple[str, dict]:
    """(layout, config) of a published drafter folder, or UserError naming the layouts tried."""
    path = directory / "config.json"
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise UserError(f"{path} is not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise UserError(f"{path} is not a JSON object")
    arch = (config.get("architectures") or [""])[0] if isinstance(config.get("architectures"), list) else ""
    if "speculators_model_type" in config:
        return "speculators", config
    if arch == "LlamaForCausalLMEagle3":
        return "eagle3", config
    if arch == "LlamaForCausalLMEagle":
        return "eagle", config
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return "medusa", config
    if config.get("num_nextn_predict_layers"):
        return "native-mtp", config
    if config.get("hidden_size") and _has_eagle1_weights(directory):
        return "eagle", config
    found = "no config.json" if not path.is_file() else f"config.json has architectures {arch or 'none'!r}"
    raise UserError(f"{directory} is not a drafter spekit can read ({found}); layouts tried: " + "; ".join(LAYOUTS))


def _has_eagle1_weights(directory: Path) -> bool:
    """An EAGLE repository EAGLE-1 checkpoint: `fc.weight` and `layers.0.*`, no `model.layers.*`."""
    from safetensors import SafetensorError, safe_open
    keys: set[str] = set()
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                keys.update(f.keys())
        except (SafetensorError, OSError):     # unreadable: read_tensors names it, once this layout is chosen
            return (directory / "config.json").is_file()
    if not keys and (directory / "pytorch_model.bin").is_file():
        keys = set(read_tensors(directory))
    return "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) and not any(
        k.startswith("model.layers.") for k in keys)


def load_published(directory: str | Path, target, kind: str | None = None) -> Head:
    """A published drafter in `directory` as a spekit head for `target`, checked to fit it; `kind`: the head kind
    the caller drafts with (eagle, eagle3, medusa, mtp), refused naming what the folder holds otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory} is not a folder")
    layout, config = detect(directory)
    holds = config.get("speculators_model_type") if layout == "speculators" else layout.replace("native-", "")
    if kind is not None and holds != kind and (layout != "speculators" or holds in ("eagle3", "mtp")):
        raise UserError(f"{directory} holds a '{holds}' drafter ({layout} layout), not '{kind}'")
    if layout == "speculators":
        from .speculators import read_speculators
        head = read_speculators(directory, config, target)
    elif layout in ("eagle", "eagle3"):
        head = _read_eagle(directory, config, target, layout)
    elif layout == "medusa":
        head = _read_medusa(directory, config, target)
    else:
        head = _read_native_mtp(directory, config, target)
    head.meta = {**getattr(head, "meta", {}), "source": str(directory), "layout": layout}
    return head.to(device=target.device).eval()


def _read_eagle(directory: Path, config: dict, target, kind: str) -> Head:
    """EAGLE-1 / EAGLE-3 in the EAGLE repository's (and SGLang's) names."""
    tensors = read_tensors(directory)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        check_same(directory, "embed_tokens.weight", embed, target.model.get_input_embeddings().weight,
                   "token embedding")
    check_target(directory, target, config.get("hidden_size"), None)
    shape = layer_shape(config, str(directory / "config.json"))
    cls = HEADS[kind]
    if kind == "eagle3":
        layers = tuple((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ())
        vocab = int(config.get("target_vocab_size") or config.get("vocab_size") or 0)
        check_target(directory, target, None, len(tensors["t2d"]) if "t2d" in tensors else vocab or None, layers)
        draft = int(config.get("draft_vocab_size") or target_info(target)["vocab_size"])
        head = cls(cls.Config(**shape, draft_vocab_size=draft, layers=layers), target_info(target))
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                 for k, v in tensors.items()}
        return fill(head, state, directory, "LlamaForCausalLMEagle3")
    check_target(directory, target, None, config.get("vocab_size"))
    head = cls(cls.Config(**shape, fc_bias="fc.bias" in tensors), target_info(target))
    state = {("layer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    return fill(head, state, directory, "EAGLE-1 (LlamaForCausalLMEagle)")


def _read_medusa(directory: Path, config: dict, target) -> Head:
    """FasterDecoding's medusa_lm_head: head h is `{h}.0 .. {h}.{L-1}` ResBlocks (`linear`) and `{h}.{L}` its own
    LM head (no bias); vLLM's MedusaModel goes to export_medusa's reader."""
    if config.get("model_type") == "medusa":
        from .export_medusa import read_vllm_medusa
        return read_vllm_medusa(directory, target)
    heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers") or 1)
    tensors = read_tensors(directory, ("medusa_lm_head.safetensors",))
    block, lm = tensors.get("0.0.linear.weight"), tensors.get(f"0.{layers}.weight")
    check_target(directory, target, None if block is None else block.shape[1], None if lm is None else lm.shape[0],
                 what="Medusa head")
    cls = HEADS["medusa"]
    head = cls(cls.Config(num_heads=heads, num_layers=layers, share_lm_head=False), target_info(target))
    state = {}
    for name, value in tensors.items():
        m = re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", name)
        if m is None:
            raise UserError(f"{directory}: unexpected tensor {name} in a Medusa head (FasterDecoding layout)")
        h, layer, part = int(m.group(1)), int(m.group(2)), m.group(3)
        state[f"lm_heads.{h}.weight" if layer == layers else f"blocks.{h}.layers.{layer}.{part}"] = value
    return fill(head, state, directory, "FasterDecoding medusa_lm_head")


def _read_native_mtp(directory: Path, config: dict, target) -> Head:
    """A DeepSeek-V3-style checkpoint's MTP layers (layers num_hidden_layers + k) as MTP modules for `target`, which
    must be the same model: the layers' copies of the embedding and LM head must equal the target's. Read by the
    loader of the model's own MTP layers (transformers' MtpModel and its checkpoint conversions, e.g. per-expert MoE
    weights), pointed at this folder."""
    import copy
    from .mtp import text_config
    from .mtp_native import load_native
    info = target_info(target)
    check_target(directory, target, config.get("hidden_size"), config.get("vocab_size"), what="checkpoint")
    first, count = int(config.get("num_hidden_layers") or 0), int(config["num_nextn_predict_layers"])
    if first != info["num_layers"]:
        raise UserError(f"{directory}: its MTP layers follow {first} decoder layers, this model has "
                        f"{info['num_layers']} (MTP layers belong to the model they were trained with)")
    arch = text_config(target.model)
    if config.get("model_type") and config["model_type"] != arch.model_type:
        raise UserError(f"{directory} holds MTP layers of a '{config['model_type']}' model, this model is "
                        f"'{arch.model_type}'")
    shared = {"embed_tokens.weight": (target.model.get_input_embeddings().weight, "token embedding"),
              "shared_head.head.weight": (target.model.get_output_embeddings().weight, "LM head")}
    for name, value in _layer_tensors(directory, [f"model.layers.{first + k}.{n}" for k in range(count)
                                                  for n in shared]).items():
        check_same(directory, name, value, *shared[name.split(".", 3)[3]])
    view = copy.copy(target.model)                 # the target, its config naming this folder and its MTP layers
    view.config = copy.copy(target.model.config)
    view.config.name_or_path = str(directory)
    view.config.num_nextn_predict_layers = view.config.num_mtp_layers = count
    return load_native(target, view)


def _layer_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Those of `names` the folder's safetensors hold (read alone, not the whole checkpoint)."""
    from safetensors import SafetensorError, safe_open
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                out.update({k: f.get_tensor(k) for k in set(f.keys()) & set(names)})
        except (SafetensorError, OSError) as err:
            raise UserError(f"{file} cannot be read ({err}); the file is corrupt or truncated") from None
    return out


OTHER_LAYOUTS.append(load_published)     # load_head reads a folder of another layout through this module
