"""Choosing a backend and loading a model (and a draft model) onto llama.cpp: `--backend torch|llama.cpp|auto`.

`auto` takes llama.cpp for a GGUF file (a bundled name or a .gguf path) when llama-cpp-python is installed and
the method runs there, torch otherwise: on a CPU llama.cpp decodes a quantized file several times faster than
PyTorch decodes its dequantized weights (docs/LLAMACPP.md), and every method that runs there keeps the same
guarantees. The torch backend stays the default and the reference."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import UserError
from .torch_models import ModelSource, cache_root, content_key, load_tokenizer, resolve
from .llama_lib import available

BACKENDS = ("torch", "llama.cpp", "auto")


def choose(backend: str, model: str, method_cls=None) -> str:
    """The backend a run takes: `backend`, with "auto" decided as the module docstring says."""
    if backend not in BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    from .llama_model import refusal
    try:
        gguf = resolve(model).gguf_file is not None
    except UserError:
        return "torch"
    ok = method_cls is None or refusal(method_cls) is None
    return "llama.cpp" if gguf and available() and ok else "torch"


def gguf_source(model: str) -> ModelSource:
    """The model's GGUF file, or UserError saying the llama.cpp backend needs one."""
    source = resolve(model)
    if source.gguf_file is None:
        raise UserError(f"--backend llama.cpp runs GGUF files, and {model} is a {source.kind} model: give a .gguf "
                        "file or a bundled name, or use --backend torch")
    return source


def gguf_file(source: ModelSource) -> str:
    return str(Path(source.path) / source.gguf_file)


def load_llama(model: str, settings, cost_profile: str = "auto"):
    """(LlamaTarget, tokenizer, source) for a GGUF model: llama.cpp reads the file as it is, the tokenizer comes
    from it too (transformers' reading, cached, so that text, chat templates and grammars are the torch path's)."""
    from .llama_model import LlamaModel
    from .llama_cpp import LlamaTarget
    source = gguf_source(model)
    lm = LlamaModel(gguf_file(source), settings, name=source.name if source.kind == "bundled" else None)
    tokenizer = load_tokenizer(source)
    return LlamaTarget(lm, settings, cost_profile), tokenizer, source


DRAFT_BACKENDS = ("same", "torch", "llama.cpp")


def load_draft(draft: str, target, backend: str = "same", dtype: str = "float32", device: str = "cpu",
               quantize: str = "none", loader=None):
    """--draft on `backend` ("same": the target's): a LlamaTarget on llama.cpp, else a LoadedModel (`loader`: the
    caller's load_model, which may keep models between runs). A draft on the other backend than its target's
    drafts alike (the proposer sees the target interface); on llama.cpp it runs with the default settings when
    its target is a torch one."""
    if backend not in DRAFT_BACKENDS:
        raise UserError(f"--draft-backend must be one of {', '.join(DRAFT_BACKENDS)}, got {backend!r}")
    on_llama = getattr(target, "backend", "torch") == "llama.cpp"
    if backend == "llama.cpp" or (backend == "same" and on_llama):
        from .llama_model import LlamaSettings
        if not available():
            raise UserError("--draft-backend llama.cpp needs llama-cpp-python: bash scripts/install.sh --llamacpp")
        return load_llama_draft(draft, target.settings if on_llama else LlamaSettings(), target)
    from .torch_models import load_model
    return (loader or load_model)(draft, dtype, device, quantize)


def load_llama_draft(draft: str, settings, target):
    """A draft model on llama.cpp beside `target`: a GGUF file, or a spekit draft folder (a trained Llama-shaped
    model, `spekit train draft`), written once as a GGUF under the spekit cache. Its vocabulary must be the
    target's (the same token texts by id), or another one: then it carries its tokenizer (`tokenizer`), through
    which the draft method reads and writes text (spekit.proposers.cross_draft)."""
    from .llama_model import LlamaModel
    from .llama_cpp import LlamaTarget
    path, allowed = _draft_gguf(draft)
    lm = LlamaModel(path, settings)
    out = LlamaTarget(lm, settings, "none")
    out.allowed = allowed
    theirs = getattr(getattr(target, "lm", None), "path", None)       # a torch target: compared by tokenizers
    if theirs is None or token_texts(path) != token_texts(theirs):
        out.tokenizer = _draft_tokenizer(draft)
    return out


def _draft_tokenizer(draft: str):
    """The tokenizer of a draft given by name, GGUF file or folder."""
    source = resolve(draft)
    if source.gguf_file is not None:
        return load_tokenizer(source)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as err:
        raise UserError(f"--draft {draft}: its vocabulary is not the target's and it has no tokenizer to read "
                        f"text with ({str(err).splitlines()[0][:120]})") from None


def token_texts(path: str) -> str:
    """A digest of a GGUF file's token texts (tokenizer.ggml.tokens)."""
    import gguf
    field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return ""
    digest = hashlib.sha256()
    for i in field.data:
        digest.update(bytes(field.parts[i]) + b"\0")
    return digest.hexdigest()


def _draft_gguf(draft: str):
    """(GGUF path, the draft vocabulary's ids or None) for --draft on llama.cpp."""
    source = resolve(draft)
    if source.gguf_file is not None:
        return gguf_file(source), None
    config = Path(source.path) / "config.json"
    info = json.loads(config.read_text()) if config.is_file() else {}
    if info.get("model_type") != "llama":
        raise UserError(f"--draft {draft}: on --backend llama.cpp a draft is a GGUF file or a Llama-shaped spekit "
                        "draft folder")
    out = cache_root() / "gguf" / f"{source.name}-{content_key(Path(source.path) / 'model.safetensors')[:12]}.gguf"
    if not out.is_file():
        _write_draft(source.path, out)
    ids = (info.get("spekit") or {}).get("draft_vocab")
    return str(out), ids


def _write_draft(folder: str, out: Path) -> None:
    """The draft folder as a q8_0 GGUF (its embedding from the model it shares it with; the head over the full
    vocabulary: the draft vocabulary is applied to its logits instead)."""
    from .torch_models import load_model
    from .gguf_write import write_llama_gguf
    loaded = load_model(folder)
    model = loaded.model
    if hasattr(model.get_output_embeddings(), "ids"):             # a reduced head: tie the full embedding back
        model.config.tie_word_embeddings = True
    tokens = loaded.tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
    bos = loaded.tokenizer.bos_token_id if loaded.tokenizer.bos_token_id is not None else 1
    eos = loaded.tokenizer.eos_token_id if loaded.tokenizer.eos_token_id is not None else 2
    write_llama_gguf(model, out, tokens=[t or f"<unused{i}>" for i, t in enumerate(tokens)], file_type="q8_0",
                     bos_id=bos, eos_id=eos, name=Path(folder).name)
