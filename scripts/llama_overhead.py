"""Where a one-token step's time goes on the llama.cpp backend: inside llama_decode and outside it (the decoding
loop's own work: reading the logits, choosing the token, bookkeeping), for spekit's `plain` and for
llama-cpp-python's `generate` on the same file and prompt, both with flash attention off (spekit's exact kernels)
and the peer also with its defaults. The three take turns, a generation each, so that a slow spell of the machine
hits all of them.

    python scripts/llama_overhead.py [--model smollm2-135m] [--tokens 200] [--repeats 3]

Prints per run the milliseconds per generated token, of them inside llama_decode and outside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

from spekit.config import SamplingConfig, UserError

PROMPT = "The history of the printing press begins"
Run = Callable[[], tuple[float, float]]         # one generation: (seconds per token, of them in llama_decode)


def spekit_plain(model: str, tokens: int) -> Run:
    from spekit.api import Spekit
    from spekit.backends import llama_cpp
    inside = [0.0]
    call = llama_cpp.LlamaTarget._call_decode

    def timed(self, on=None):
        t = time.perf_counter()
        call(self, on)
        inside[0] += time.perf_counter() - t
    llama_cpp.LlamaTarget._call_decode = timed
    sk = Spekit.load(model, "plain", backend="llama.cpp")
    cfg = SamplingConfig(max_new_tokens=tokens)

    def run() -> tuple[float, float]:
        inside[0] = 0.0
        t = time.perf_counter()
        n = len(sk.generate([PROMPT], cfg, chat=False)[0].result.token_ids)
        sk.engine.target.drop_prefixes()
        return (time.perf_counter() - t) / n, inside[0] / n
    return run


def peer(model: str, tokens: int, flash: bool) -> Run:
    import llama_cpp
    from llama_cpp import _internals
    from spekit.backends.loading import gguf_file, gguf_source
    inside = [0.0]
    decode = _internals.LlamaContext.decode

    def timed(self, batch):
        t = time.perf_counter()
        out = decode(self, batch)
        inside[0] += time.perf_counter() - t
        return out
    _internals.LlamaContext.decode = timed
    kwargs = {} if flash else {"flash_attn": False}
    llm = llama_cpp.Llama(model_path=gguf_file(gguf_source(model)), n_ctx=4096, verbose=False,
                          n_threads=os.cpu_count() or 1, **kwargs)
    ids = llm.tokenize(PROMPT.encode())

    def run() -> tuple[float, float]:
        inside[0], out = 0.0, []
        t = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, reset=True):
            out.append(tok)
            if len(out) >= tokens:
                break
        return (time.perf_counter() - t) / len(out), inside[0] / len(out)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        print("error: --tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        runners = {"spekit plain (exact kernels)": spekit_plain(args.model, args.tokens),
                   "llama-cpp-python, flash attention off": peer(args.model, args.tokens, False),
                   "llama-cpp-python, its defaults": peer(args.model, args.tokens, True)}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for turn in range(args.repeats + 1):             # the first turn warms each up, uncounted
        for name, run in runners.items():
            measured = run()
            if turn:
                results[name].append(measured)
    print(f"{args.model}, {args.tokens} tokens, median of {args.repeats} (ms per token)")
    print(f"{'':<40}{'total':>8}{'decode':>8}{'outside':>9}")
    for name, runs in results.items():
        total = statistics.median(r[0] for r in runs) * 1000
        inside = statistics.median(r[1] for r in runs) * 1000
        print(f"{name:<40}{total:>8.2f}{inside:>8.2f}{total - inside:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
