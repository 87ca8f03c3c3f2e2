"""llama-cpp-python, found and checked once: the low-level module, its log silenced, and a GGUF file looked at
before llama.cpp reads it (a missing, truncated or non-GGUF file is a one-line UserError here, never a crash in
the C library)."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import struct
from pathlib import Path

from ..config import UserError

INSTALL = "bash scripts/install.sh --llamacpp (or pip install llama-cpp-python; it compiles llama.cpp, a few minutes)"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@functools.cache
def lib():
    """The `llama_cpp` module, its backend initialised and its log quiet (llama.cpp prints every load to stderr).
    UserError when llama-cpp-python is not installed."""
    if not available():
        raise UserError(f"the llama.cpp backend needs llama-cpp-python, which is not installed: {INSTALL}")
    # the tiled K-quant matrix products (for 8+ rows) round otherwise than one-row products; the switch is read
    # once per process, before the first product, so it is set here (GGML_CPU_TILED_MM=1 in the environment keeps
    # them, for --llama-kernels fast)
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    import llama_cpp

    llama_cpp.llama_backend_init()
    if not os.environ.get("SPEKIT_LLAMA_LOG"):
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    return llama_cpp


def _drop(level, text, data) -> None:
    return None


def _quiet():
    import llama_cpp
    return llama_cpp.llama_log_callback(_drop)


# kept alive for the process: llama.cpp calls it from C
_QUIET = _quiet() if available() else None


def rounding_apart() -> list[str]:
    """What makes this llama.cpp round a wide forward otherwise than a one-token one, whatever spekit's settings:
    its llamafile kernels (compiled in: matrix products over 2+ rows of Q8_0, Q4_0, Q5_0, F16 ... take them, one
    row takes the vector-dot path) and the tiled K-quant products when switched on. [] when neither."""
    apart = []
    if b"LLAMAFILE = 1" in lib().llama_print_system_info():
        apart.append("this llama-cpp-python was built with llamafile kernels (bash scripts/install.sh --llamacpp "
                     "builds one without)")
    if os.environ.get("GGML_CPU_TILED_MM", "0") not in ("0", ""):
        apart.append("GGML_CPU_TILED_MM turns the tiled K-quant products on")
    return apart


def version() -> str:
    return getattr(lib(), "__version__", "?")


def check_gguf(path: str | os.PathLike) -> Path:
    """The file, once it is seen to be a whole GGUF: it exists, starts with the GGUF magic, its header parses and
    its tensors' data lie inside it. Else UserError naming what is wrong. A file is read once a process while it
    is unchanged (its header holds the whole vocabulary, which the gguf reader parses slowly, and the model and
    its tokenizer both ask)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"cannot load {path}: no such GGUF file")
    stat = path.stat()
    return _checked(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _checked(path: Path, size: int, modified: int) -> Path:
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"cannot load {path}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(path))
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except (struct.error, ValueError, IndexError, KeyError, OSError, EOFError) as err:
        raise UserError(f"cannot load {path}: a damaged or truncated GGUF file ({type(err).__name__}: {err}); "
                        "download or convert it again") from None
    if end > size:
        raise UserError(f"cannot load {path}: a truncated GGUF file ({size} bytes, its tensors need {end}); "
                        "download or convert it again")
    return path
