"""Which llama.cpp settings give a token the same logits in a wide forward as in a one-token step, and whether
where its cache cells lie matters: the facts behind the llama.cpp backend's exact kernels (docs/LLAMACPP.md).

    python scripts/llama_rounding.py [--model smollm2-135m] [--context 300] [--tokens 16]

For each setting (flash attention off / on, repacked weights or not, cache type f16 / bf16 / f32) it prints the
largest logit difference between --tokens tokens decoded one at a time and the same tokens decoded in one batch
after a --context-token prompt, then between decoding the prompt into cells 0, 1, 2, ... and the same with
another sequence's cells in front of it (3 of them) or between its own (every fifth cell). 0 means bit for bit.
The build matters too: a llama.cpp with llamafile kernels rounds products over 2+ rows otherwise whatever the
settings (this script prints the build's flags). Set GGML_CPU_TILED_MM=1 to see the tiled K-quant products.
With --steps N it then times N one-token steps of every setting after the prompt, the settings taking turns at
each step so that a slow spell of the machine hits them all, and prints each one's median against the first's.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("GGML_CPU_TILED_MM", "0")
import llama_cpp as L  # noqa: E402

from spekit.backends.loading import gguf_file, gguf_source  # noqa: E402
from spekit.config import UserError  # noqa: E402

QUIET = L.llama_log_callback(lambda level, text, data: None)
TYPES = {"f16": 1, "bf16": 30, "f32": 0}
SETTINGS = {  # name: (flash attention, repacked weights, cache type)
    "fa off, f16 cache": (0, False, "f16"), "fa off, f16, repacked": (0, True, "f16"),
    "fa on, f16 cache": (1, False, "f16"), "fa on, f32 cache": (1, False, "f32"),
    "fa on, bf16 cache": (1, False, "bf16"), "fa on, bf16, repacked": (1, True, "bf16")}


class Session:
    """One model and context of a setting, with a batch of up to 512 tokens."""

    def __init__(self, path: str, fa: int, repack: bool, kv: str, n_ctx: int):
        params = L.llama_model_default_params()
        params.use_extra_bufts = repack
        self.model = L.llama_model_load_from_file(path.encode(), params)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, 512, 512, 4
        cp.n_threads = cp.n_threads_batch = os.cpu_count() or 1
        cp.flash_attn_type, cp.type_k, cp.type_v, cp.kv_unified, cp.swa_full = fa, TYPES[kv], TYPES[kv], True, True
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.batch = L.llama_batch_init(512, 0, 4)

    def decode(self, tokens: list[int], start: int, seq: int = 0, logits: bool = True) -> np.ndarray:
        """Decode tokens at positions start, start + 1, ... of `seq`; their logits [n, V] (or none)."""
        if len(tokens) > 512:       # the batch's size: a long prompt goes in parts
            self.decode(tokens[:-512], start, seq, logits=False)
            return self.decode(tokens[-512:], start + len(tokens) - 512, seq, logits)
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, logits
            b.seq_id[i][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        if not logits:
            return np.empty((0, self.vocab))
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(tokens), self.vocab)).copy()

    def close(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)


def one_by_one_vs_batch(s: Session, prompt: list[int], more: list[int]) -> float:
    mem = L.llama_get_memory(s.ctx)
    s.decode(prompt, 0, logits=False)
    single = np.concatenate([s.decode([t], len(prompt) + i) for i, t in enumerate(more)])
    L.llama_memory_seq_rm(mem, 0, len(prompt), -1)
    wide = s.decode(more, len(prompt))
    L.llama_memory_clear(mem, True)
    return float(np.abs(single - wide).max())


def layout(s: Session, prompt: list[int], before: int, every: int) -> np.ndarray:
    """Logits of the prompt decoded one token at a time, after `before` cells of another sequence, with one of its
    cells between every `every` of the prompt's (0: none)."""
    mem = L.llama_get_memory(s.ctx)
    if before:
        s.decode([7] * before, 0, seq=1, logits=False)
    out, junk = [], 0
    for i, t in enumerate(prompt):
        out.append(s.decode([t], i)[0])
        if every and i % every == 0:
            s.decode([9], before + junk, seq=1, logits=False)
            junk += 1
    L.llama_memory_clear(mem, True)
    return np.stack(out)


def step_times(sessions: dict[str, Session], prompt: list[int], steps: int) -> dict[str, float]:
    """Median seconds of a one-token step (its logits read) per setting, after `prompt`; greedy tokens follow."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    last = {}
    for name, s in sessions.items():
        last[name] = int(s.decode(prompt, 0)[-1].argmax())
    for i in range(steps):
        for name, s in sessions.items():
            t = time.perf_counter()
            last[name] = int(s.decode([last[name]], len(prompt) + i)[0].argmax())
            times[name].append(time.perf_counter() - t)
    for s in sessions.values():
        L.llama_memory_clear(L.llama_get_memory(s.ctx), True)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="then time this many one-token steps of each setting")
    args = ap.parse_args(argv)
    try:
        if not (1 <= args.context <= 3000 and 1 <= args.tokens <= 64 and args.steps >= 0):
            raise UserError("--context must be in [1, 3000], --tokens in [1, 64] and --steps >= 0")
        path = gguf_file(gguf_source(args.model))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    L.llama_log_set(QUIET, ctypes.c_void_p(0))
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 20000, args.context)]
    more = [int(x) for x in rng.integers(100, 20000, args.tokens)]
    short = prompt[:60]
    print(f"{args.model}: largest logit difference (0: bit for bit)")
    print(f"{'setting':<24}{'1-by-1 vs batch':>18}{'3 cells before':>16}{'cells between':>15}")
    sessions = {}
    for name, (fa, repack, kv) in SETTINGS.items():
        s = sessions[name] = Session(path, fa, repack, kv, 2 * (args.context + args.tokens) + 256 + args.steps)
        base = layout(s, short, 0, 0)
        shifted = float(np.abs(layout(s, short, 3, 0) - base).max())
        holes = float(np.abs(layout(s, short, 0, 5) - base).max())
        print(f"{name:<24}{one_by_one_vs_batch(s, prompt, more):>18.4g}{shifted:>16.4g}{holes:>15.4g}")
    if args.steps:
        times = step_times(sessions, prompt, args.steps)
        first = next(iter(times.values()))
        print(f"one-token steps after {args.context} tokens (median of {args.steps}, ms; against the first setting)")
        for name, t in times.items():
            print(f"{name:<24}{t * 1000:>8.2f}{t / first:>8.3f}x")
    for s in sessions.values():
        s.close()
    print(L.llama_print_system_info().decode().strip(), "| GGML_CPU_TILED_MM =", os.environ["GGML_CPU_TILED_MM"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
