"""The llama.cpp backend's settings and its loaded GGUF model: what the `--backend llama.cpp` flags set, the model's
weights as llama.cpp loads them, and which methods this backend cannot run (`refusal`)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace

from ..config import UserError
from .llama_lib import check_gguf, lib, version

SPARE = 2                # streams beyond --parallel: kept prefixes, copies of shared prefills, scoring


@dataclass(frozen=True)
class LlamaSettings:
    """How llama.cpp runs the file (`--ctx-size`, `--threads`, `--llama-kernels` on the commands).

    kernels "exact": the kernels whose every output row is computed alike whether the forward carries one token or
    many (no repacked weight layouts, no tiled K-quant products, no flash attention), so that a verification forward
    gives a node the very logits a one-token step would, and greedy output equals plain decoding token for token.
    That also needs a llama.cpp built without its llamafile kernels (`scripts/install.sh --llamacpp` builds one);
    `exactness()` says whether this build is. "fast": llama.cpp's defaults (repacking, tiled products, flash
    attention where it chooses), faster to prefill, whose wide forwards round otherwise than one-token ones:
    greedy output may then leave plain's at close calls (spekit bench counts them).

    prefill "fast" (with the exact kernels): a prompt part of `llama_prefill.MIN_TOKENS` tokens or more is computed
    by a second context with flash attention and repacked weights (15-30% faster on long prompts) and its cache
    rows moved into the exact context; every method computes its prompts so, so greedy output still equals this
    backend's plain decoding. "exact": prompts too go through the exact context (a prompt computed afresh or
    taken over from a kept prefix then gives the same cache bit for bit)."""
    ctx_size: int = 4096        # cache cells per row (prompt, answer and the step's draft tokens)
    parallel: int = 1           # rows decoded at once (a batch, a server's concurrent requests)
    threads: int = 0            # 0: every core this process may run on
    kernels: str = "exact"      # exact | fast
    batch: int = 512            # tokens per decode call (llama.cpp's n_batch and n_ubatch)
    prefill: str = "fast"       # fast | exact: the kernels that compute prompts (with the exact kernels)

    def __post_init__(self) -> None:
        if self.ctx_size < 16:
            raise UserError(f"--ctx-size must be at least 16, got {self.ctx_size}")
        if self.parallel < 1:
            raise UserError(f"--parallel must be at least 1, got {self.parallel}")
        if self.threads < 0 or self.batch < 1:
            raise UserError(f"--threads must be >= 0 and the llama.cpp batch >= 1, got {self.threads}, {self.batch}")
        if self.kernels not in ("exact", "fast"):
            raise UserError(f"--kernels must be exact or fast, got {self.kernels!r}")
        if self.prefill not in ("exact", "fast"):
            raise UserError(f"--prefill-kernels must be exact or fast, got {self.prefill!r}")

    @property
    def exact(self) -> bool:
        return self.kernels == "exact"

    @property
    def streams(self) -> int:
        """Sequences the context holds: the rows, and spares (kept prefixes, shared prefills, scoring)."""
        return self.parallel + SPARE

    def cores(self) -> int:
        import os
        return self.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def context_params(L, settings: LlamaSettings, seqs: int, flash: int, unified: bool):
    """llama.cpp's context parameters for these settings: `seqs` sequence ids, flash attention (0 off, 1 on, -1
    llama.cpp's choice), one unified cache or a stream per sequence (a row's cells never mix with another's)."""
    params = L.llama_context_default_params()
    params.n_ctx = settings.ctx_size * settings.streams
    params.n_batch = params.n_ubatch = settings.batch
    params.n_seq_max = seqs
    params.n_threads = params.n_threads_batch = settings.cores()
    params.flash_attn_type = flash
    params.kv_unified = unified
    params.swa_full = True            # sliding-window layers keep every cell, so any position can be dropped
    params.no_perf = True
    return params


def refusal(proposer_cls) -> str | None:
    """Why a method cannot run on this backend, or None."""
    if proposer_cls.needs_hidden_states:
        return (f"method '{proposer_cls.name}' reads the target's hidden states, which llama.cpp's decode does not "
                "hand over; use --backend torch, or a method that needs none (ngram, rest, recycle, lookahead, "
                "jacobi, draft)")
    if getattr(proposer_cls, "needs_target_layers", False):
        return (f"method '{proposer_cls.name}' runs the target's own layers apart from its forward, which "
                "llama.cpp does not offer; use --backend torch")
    return None


class LlamaModel:
    """A GGUF file loaded by llama.cpp (weights only; contexts are made by LlamaTarget)."""

    def __init__(self, path: str, settings: LlamaSettings, name: str | None = None):
        L = lib()
        self.path = str(check_gguf(path))
        params = L.llama_model_default_params()
        params.use_extra_bufts = not settings.exact
        params.n_gpu_layers = 0
        self.ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise UserError(f"{path}: llama.cpp could not load this GGUF file (an architecture this llama.cpp "
                            f"{version()} does not know, or a damaged file); set SPEKIT_LLAMA_LOG=1 to see why")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_params = int(L.llama_model_n_params(self.ptr))
        self.size = int(L.llama_model_size(self.ptr))
        arch = _meta(L, self.ptr, "general.architecture") or "?"
        self.config = SimpleNamespace(
            _name_or_path=name or self.path, model_type=arch, vocab_size=self.vocab_size,
            hidden_size=int(L.llama_model_n_embd(self.ptr)), num_hidden_layers=int(L.llama_model_n_layer(self.ptr)),
            max_position_embeddings=int(L.llama_model_n_ctx_train(self.ptr)))
        self.stop_ids = tuple(sorted({t for t in (L.llama_vocab_eos(self.vocab), L.llama_vocab_eot(self.vocab))
                                      if 0 <= t < self.vocab_size}))

    def __del__(self):
        if getattr(self, "ptr", None):
            lib().llama_model_free(self.ptr)
            self.ptr = None


def _meta(L, model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else None
