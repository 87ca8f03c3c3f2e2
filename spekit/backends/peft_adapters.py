"""Fine-tuned adapters (PEFT: LoRA and the other kinds that merge into the weights) on a base model.

An adapter is merged into its base at load, in float32, before any cast or quantization: the target is then an
ordinary model, so every method, the row-invariant forms, the cost profiles and the training of drafters work on
it unchanged, and no step pays for the adapter's extra matmuls. `--model ADAPTER_DIR` loads the base its
adapter_config.json names (`base_model_name_or_path`); `spekit merge --model BASE --adapter DIR --out OUT` puts it
on a base of your choosing (a bundled name, a folder or a .gguf, when the named one is a hub id this machine cannot
reach) and writes the merged model as a Hugging Face folder that loads anywhere (`--model OUT`, vLLM, SGLang).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..config import UserError

CONFIG = "adapter_config.json"


def is_adapter(path: Path) -> bool:
    return (path / CONFIG).is_file()


def base_of(adapter: str) -> str:
    """The base model an adapter folder names. Raises UserError when it names none."""
    try:
        cfg = json.loads((Path(adapter) / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{adapter}/{CONFIG} is not readable JSON: {err}") from err
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not base:
        raise UserError(f"{adapter}/{CONFIG} names no base model (base_model_name_or_path): merge it onto one with "
                        f"spekit merge --model BASE --adapter {adapter} --out DIR")
    return str(base)


WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def check_weights(adapter: str) -> None:
    """Refuse, before the base model loads, an adapter folder without its weights (peft would then look for them on
    the hub) or with a safetensors file whose header cannot be read (corrupt or truncated)."""
    found = [Path(adapter) / name for name in WEIGHTS if (Path(adapter) / name).is_file()]
    if not found:
        raise UserError(f"the adapter folder {adapter} holds its {CONFIG} but no weights ({' or '.join(WEIGHTS)})")
    if found[0].suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(found[0]), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise UserError(f"{found[0]} cannot be read ({err}); the file is corrupt or truncated") from None


def _peft():
    try:
        import peft
    except ImportError as err:
        raise UserError("loading an adapter needs the peft package: pip install 'spekit[lora]'") from err
    return peft


def merged(adapter: str, base: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the adapter in folder `adapter` merged into `base` (default: the base it names), float32,
    on the CPU. The adapter's own tokenizer is used when it saved one (added tokens grow the embedding first)."""
    from .torch_models import ModelNotFound, _short, load_model

    peft = _peft()
    name = base or base_of(adapter)
    if Path(name).expanduser().resolve() == Path(adapter).resolve():
        raise UserError(f"{adapter}/{CONFIG} names the adapter itself as its base model")
    check_weights(adapter)
    try:
        loaded = load_model(name, dtype="float32")
    except ModelNotFound as err:
        if base is not None:
            raise UserError(f"--model {name!r} cannot be loaded here ({err})") from err
        raise UserError(f"the adapter {adapter} is for the base model {name!r}, which cannot be loaded here ({err}); "
                        f"merge it onto a copy you have: spekit merge --model BASE --adapter {adapter} --out DIR") from err
    model, tokenizer = loaded.model, loaded.tokenizer
    if (Path(adapter) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(adapter)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = peft.PeftModel.from_pretrained(model, adapter)
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        raise UserError(f"cannot put the adapter {adapter} on {name!r}: {_short(err)}") from err
    if not hasattr(wrapped, "merge_and_unload"):
        kind = getattr(wrapped.peft_config.get("default"), "peft_type", "this kind")
        raise UserError(f"{adapter}: {kind} adapters do not merge into the weights (prompt tuning and the like); "
                        "spekit takes adapters that do (LoRA, DoRA, IA3, LoHa, LoKr, ...)")
    return wrapped.merge_and_unload().eval(), tokenizer


