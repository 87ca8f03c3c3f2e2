"""MTP modules where they come from: a head directory, the checkpoint's own MTP layers (DeepSeek-V3 layout:
`num_nextn_predict_layers`, layers numbered from num_hidden_layers with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and the decoder block's usual names), or modules shipped with
spekit; and the export of trained modules into that layout (the model's checkpoint with the modules appended).

The checkpoint's layers are read by transformers' own `MtpModel` loader (its checkpoint-to-module conversions, e.g.
per-expert MoE weights into fused ones), told to look for the layers right after the model's last one."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..config import UserError
from .base import check_out, load_head, staged_dir, target_info
from .base import shipped_dir as _shipped
from .mtp import MtpConfig, MtpHead, arch_of, text_config



def native_count(model) -> int:
    """MTP layers the model's config declares (transformers' `num_mtp_layers`, DeepSeek's name as fallback)."""
    cfg = text_config(model)
    return int(getattr(cfg, "num_mtp_layers", None) or getattr(cfg, "num_nextn_predict_layers", None) or 0)


_LOADER = []


def _loader() -> type:
    """transformers' MtpModel, finding the MTP layers at num_hidden_layers .. + num_mtp_layers - 1 (its own pattern
    comes from the model class, e.g. DeepSeek-V3's fixed `layers.61`), with MtpModel's checkpoint conversions."""
    if not _LOADER:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
        from transformers.modeling_layers import MtpModel

        class CheckpointMtp(MtpModel):
            @staticmethod
            def get_mtp_weights_regex(main_model) -> re.Pattern:
                cfg = main_model.config.get_text_config()
                ids = "|".join(str(cfg.num_hidden_layers + k) for k in range(native_count(main_model)))
                return re.compile(rf"^model\.layers\.({ids})\.")

        register_checkpoint_conversion_mapping(CheckpointMtp.__name__, get_checkpoint_conversion_mapping("MtpModel"),
                                               overwrite=True)
        _LOADER.append(CheckpointMtp)
    return _LOADER[0]


def _checkpoint_dir(model) -> Path:
    path = Path(str(getattr(model.config, "name_or_path", "") or ""))
    if not path.is_dir() or not (list(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()):
        raise UserError(f"the model declares {native_count(model)} MTP layers but its checkpoint folder "
                        f"{str(path)!r} holds no safetensors to read them from")
    return path


def _check_shapes(model, folder: Path) -> None:
    """The MTP-specific tensors must fit the model (a clear error before transformers' loader sees them)."""
    cfg = text_config(model)
    hidden, first = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    want = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
            "shared_head.norm.weight": (hidden,)}
    found = set()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", key)
                    if m and int(m.group(1)) >= first and m.group(2) in want:
                        shape = tuple(f.get_slice(key).get_shape())
                        if shape != want[m.group(2)]:
                            raise UserError(f"{file.name}: MTP weight {key} has shape {list(shape)}, this model "
                                            f"(hidden size {hidden}) needs {list(want[m.group(2)])}")
                        found.add(int(m.group(1)))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{file} cannot be read ({err}); the file is corrupt or truncated") from None
    missing = [first + k for k in range(native_count(model)) if first + k not in found]
    if missing:
        raise UserError(f"the model declares {native_count(model)} MTP layers but {folder} lacks layer(s) {missing}")


def load_native(target, model=None) -> MtpHead:
    """The MTP layers the target's checkpoint carries, as an MtpHead (the target's embedding and head shared).
    model: the target's model with a config naming another checkpoint folder and its MTP layers (--heads DIR, see
    spekit.heads.published); default: the target's own."""
    model = model if model is not None else target.model
    folder = _checkpoint_dir(model)
    _check_shapes(model, folder)
    count = native_count(model)
    try:
        mtp = _loader().from_pretrained(model, device_map={"": target.device})
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(f"the MTP layers in {folder} do not fit this model: {_first_line(err)}") from None
    head = MtpHead(MtpConfig(count, 0), {**target_info(target), "arch": text_config(target.model).to_dict()})
    try:
        head.layers.load_state_dict(mtp.layers.state_dict())
    except RuntimeError as err:
        raise UserError(f"the MTP layers in {folder} do not fit this model: {_first_line(err)}") from None
    head.meta = {"source": str(folder)}
    return head


def shipped_dir(target) -> Path | None:
    """Modules shipped with spekit that were trained for a model of this shape and architecture."""
    arch = text_config(target.model).model_type
    return _shipped("mtp", target, lambda info: info["target"].get("arch", {}).get("model_type") == arch)


def load_mtp_head(directory: str | Path, target) -> MtpHead:
    """load_head for MTP modules, with the mismatches load_head leaves to torch turned into UserErrors."""
    try:
        head = load_head(directory, target, kind="mtp")
    except RuntimeError as err:
        raise UserError(f"{directory}/model.safetensors does not fit this model: {_first_line(err)}") from None
    arch = text_config(target.model).model_type
    if arch_of(head) != arch:
        raise UserError(f"{directory} holds MTP modules for a '{arch_of(head)}' model, this model is '{arch}'")
    return head


def find_modules(target, heads: str = "") -> MtpHead:
    """--heads DIR, else the checkpoint's own MTP layers, else shipped modules for this model."""
    if heads:
        return load_mtp_head(heads, target)
    if native_count(target.model):
        return load_native(target)
    shipped = shipped_dir(target)
    if shipped is not None:
        return load_mtp_head(shipped, target)
    raise UserError("this model carries no MTP layers and spekit ships no MTP modules for it: pass --heads DIR "
                    "(modules trained with `spekit train mtp`)")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def export_mtp(head_dir: str | Path, out_dir: str | Path, model: str = "smollm2-135m",
               dtype: str = "float32") -> Path:
    """Write `model` with the trained modules of `head_dir` appended in the DeepSeek-V3 layout (layers
    num_hidden_layers + k, config `num_nextn_predict_layers`): a checkpoint folder that `--method mtp` (and
    transformers' MTP generation) uses natively."""
    from ..backends.torch_models import load_model

    check_out(out_dir, "export", source=head_dir)           # before the model loads
    loaded = load_model(model, dtype=dtype)
    return write_export(loaded.model, loaded.tokenizer, head_dir, out_dir)


def write_export(model, tokenizer, head_dir: str | Path, out_dir: str | Path) -> Path:
    """export_mtp for a loaded model (tokenizer may be None). Written to a temporary folder, then renamed."""
    from ..backends.torch_target import Target

    target = Target(model, fast=False)
    head = load_mtp_head(head_dir, target)
    if head.config.draft_vocab:
        print(f"[spekit] {head_dir}: the DeepSeek-V3 layout has no draft vocabulary; the exported modules draft "
              f"over the whole vocabulary (the same weights)", file=sys.stderr)
    if head.config.intermediate_size not in (0, int(getattr(target.config, "intermediate_size", 0) or 0)):
        raise UserError(f"{head_dir}: these modules' blocks are narrower than the model's layers (MLP width "
                        f"{head.config.intermediate_size}, the model's {target.config.intermediate_size}); the "
                        f"DeepSeek-V3 layout needs blocks shaped like the model's own")
    out = check_out(out_dir, "export", source=head_dir)
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _append_tensors(tmp, _deepseek_tensors(head, target))
        config = json.loads((tmp / "config.json").read_text())
        config.update(num_nextn_predict_layers=len(head.layers), num_mtp_layers=len(head.layers),
                      spekit={"kind": "mtp", "meta": getattr(head, "meta", {})})    # marks the folder as spekit's
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _deepseek_tensors(head: MtpHead, target) -> dict[str, torch.Tensor]:
    """The modules' weights under DeepSeek-V3 names (the block's in the checkpoint's own format, e.g. per-expert MoE
    weights, by transformers' reverse conversion), the shared embedding and LM head copied per layer as there."""
    first = target.num_layers
    embed = target.model.get_input_embeddings().weight.detach()
    lm_head = target.model.get_output_embeddings().weight.detach()
    out, block = {}, {}
    for k, layer in enumerate(head.layers):
        prefix = f"model.layers.{first + k}."
        for name, value in layer.state_dict().items():
            if name.startswith("mtp_block."):
                block[prefix + name[len("mtp_block."):]] = value
            else:
                out[prefix + name.replace("post_norm.", "shared_head.norm.", 1)] = value
        out[prefix + "embed_tokens.weight"] = embed
        out[prefix + "shared_head.head.weight"] = lm_head
    from transformers.core_model_loading import revert_weight_conversion
    out.update(revert_weight_conversion(target.model, block))
    return {k: v.detach().to(target.dtype).contiguous().clone() for k, v in out.items()}


def _append_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a saved checkpoint: into model.safetensors when it is a single file (transformers then reads
    no other file), else as one more shard listed in the index."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        tensors = {**load_file(str(folder / "model.safetensors")), **tensors}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    save_file(tensors, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    info = json.loads(index.read_text())
    info["weight_map"].update({k: "mtp.safetensors" for k in tensors})
    index.write_text(json.dumps(info, indent=2) + "\n")
