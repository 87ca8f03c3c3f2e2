"""Where a one-token step's time goes on the llama.cpp backend: inside llama_decode and outside it (the decoding
loop's own work: reading the logits, choosing the token, bookkeeping), for spekit's `plain` and for
llama-cpp-python's `generate` on the same file and prompt, both with flash attention off (spekit's exact kernels)
and the peer also with its defaults. The three take turns, a generation each (or, with --per-token, a token each,
as `spekit bench --lockstep` runs its contestants), so that a slow spell of the machine hits all of them.

    python scripts/llama_overhead.py [--model smollm2-135m] [--tokens 200] [--repeats 3] [--per-token]

Prints per run the milliseconds per generated token, of them inside llama_decode and outside it (the first token,
which carries the prompt's prefill, is not counted).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Iterator

from spekit.config import SamplingConfig, UserError

PROMPT = "The history of the printing press begins"
Stream = Callable[[], Iterator[None]]      # one generation, a `next` per generated token
DECODE = {"spekit": 0.0, "peer": 0.0}       # seconds inside llama_decode so far, per library
_PATCHED: set[str] = set()


def _timed(cls, name: str, key: str) -> None:
    """Count the seconds spent in cls.name into DECODE[key] (once per library)."""
    if key in _PATCHED:
        return
    _PATCHED.add(key)
    call = getattr(cls, name)

    def timed(self, *args):
        t = time.perf_counter()
        out = call(self, *args)
        DECODE[key] += time.perf_counter() - t
        return out
    setattr(cls, name, timed)


def spekit_plain(model: str, tokens: int) -> tuple[Stream, str]:
    from spekit.api import Spekit
    from spekit.backends import llama_cpp
    _timed(llama_cpp.LlamaTarget, "_call_decode", "spekit")
    sk = Spekit.load(model, "plain", backend="llama.cpp")
    cfg = SamplingConfig(max_new_tokens=tokens)
    ids = sk.tokenizer.encode(PROMPT)

    def stream() -> Iterator[None]:
        for event in sk.engine.stream([ids], cfg):
            for _ in event.tokens:
                yield
        sk.engine.target.drop_prefixes()
    return stream, "spekit"


def peer(model: str, tokens: int, flash: bool) -> tuple[Stream, str]:
    import llama_cpp
    from llama_cpp import _internals
    from spekit.backends.loading import gguf_file, gguf_source
    _timed(_internals.LlamaContext, "decode", "peer")
    kwargs = {} if flash else {"flash_attn": False}
    llm = llama_cpp.Llama(model_path=gguf_file(gguf_source(model)), n_ctx=4096, verbose=False,
                          n_threads=os.cpu_count() or 1, **kwargs)
    ids = llm.tokenize(PROMPT.encode())

    def stream() -> Iterator[None]:
        for n, _ in enumerate(llm.generate(ids, temp=0.0, reset=True), 1):
            yield
            if n >= tokens:
                return
    return stream, "peer"


def turns(runners: dict[str, tuple[Stream, str]], per_token: bool) -> dict[str, tuple[float, float]]:
    """One generation of each runner, one after another or a token each in turn; per runner (seconds per token,
    of them in llama_decode), the first token (the prefill) left out."""
    live = {name: stream() for name, (stream, _) in runners.items()}
    spent = {name: [0.0, 0.0, 0] for name in runners}          # seconds, in decode, tokens

    def step(name: str) -> bool:
        key = runners[name][1]
        before, t = DECODE[key], time.perf_counter()
        if next(live[name], StopIteration) is StopIteration:
            return False
        seconds, inside = time.perf_counter() - t, DECODE[key] - before
        s = spent[name]
        if s[2] >= 0:
            s[0], s[1] = s[0] + seconds, s[1] + inside
        s[2] += 1
        return True
    for s in spent.values():
        s[2] = -1                                               # the first token is the prefill's
    if per_token:
        while live:
            for name in list(live):
                if not step(name):
                    del live[name]
    else:
        for name in runners:
            while step(name):
                pass
    return {name: (s[0] / s[2], s[1] / s[2]) for name, s in spent.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-token", action="store_true", help="the runners take a token each in turn")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        print("error: --tokens must be >= 2 and --repeats >= 1", file=sys.stderr)
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
        for name, measured in turns(runners, args.per_token).items():
            if turn:
                results[name].append(measured)
    how = "a token each in turn" if args.per_token else "a generation each in turn"
    print(f"{args.model}, {args.tokens} tokens, {how}, median of {args.repeats} (ms per token)")
    print(f"{'':<40}{'total':>8}{'decode':>8}{'outside':>9}")
    for name, runs in results.items():
        total = statistics.median(r[0] for r in runs) * 1000
        inside = statistics.median(r[1] for r in runs) * 1000
        print(f"{name:<40}{total:>8.2f}{inside:>8.2f}{total - inside:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
