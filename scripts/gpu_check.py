"""Checks and timings of the CUDA path (CUDA-graph replay of the target step), which CI's CPUs cannot run. A
program for a machine with a GPU, not a test:

    python scripts/gpu_check.py --out runs/gpu_check.json [--device cuda] [--reps 20]

1. Exactness, on the tests' tiny random models in float32: each method's greedy answer with CUDA graphs equals
   its answer without them and plain's answer on the same device, and again after another generation (which
   replays the graphs recorded by the first: the seconds spent recording anew are reported); a seeded sampled answer is the same with graphs
   on and off. The number of graphs recorded and any fall-back to the ordinary forward are reported.
2. The cost of one target step on a random model shaped like SmolLM2-135M (30 layers, vocabulary 49152): ms per
   forward over 1..64 new tokens at a 512-token context, graphs on and off, in bfloat16 and float32, and plain
   decoding's tok/s. Random weights decide nothing about acceptance; they cost what the real ones cost.
On a CPU (--device cpu) part 1 runs the static form without capture, as the tests do.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_gemma3, tiny_llama  # noqa: E402  (the tests' own tiny models)

from spekit import proposers  # noqa: E402
from spekit.config import SamplingConfig  # noqa: E402
from spekit.engine import Engine  # noqa: E402
from spekit.backends.cuda_graphs import capture_seconds  # noqa: E402
from spekit.backends.torch_target import Target  # noqa: E402

PROMPTS = [[1, 5, 9, 3, 1, 5, 9], [7, 8, 2, 11, 4, 6, 9, 10, 3, 7, 8, 2], [4, 4, 4, 4, 4, 4]]
METHODS = [("plain", {}), ("ngram", {"num_draft_tokens": 6}), ("lookahead", {}), ("jacobi", {"block_size": 5}),
           ("early-exit", {"exit_layer": 1}), ("draft", {}), ("recycle", {}), ("rest", {})]


def engine(method: str, options: dict, model, draft_model, graphs: bool, static: bool) -> Engine:
    cls = proposers.get(method)
    target = Target(model, cuda_graphs=graphs, static=static)
    draft = None if draft_model is None else Target(draft_model, cuda_graphs=graphs, static=static)
    return Engine(target, cls(target, cls.Options(**options), draft))


def answers(eng: Engine, cfg: SamplingConfig, prompts=PROMPTS) -> tuple[list[list[int]], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = eng.generate(prompts, cfg)
    return [r.token_ids for r in rows], [str(w.message)[:200] for w in caught]


def exactness(device: str) -> list[dict]:
    static = device == "cpu"                       # the CPU runs the static form without capture
    llama, draft = tiny_llama(seed=0).to(device), tiny_llama(seed=1, layers=1).to(device)
    greedy = SamplingConfig(max_new_tokens=40)
    plain, _ = answers(engine("plain", {}, llama, None, graphs=False, static=False), greedy)
    out = []
    for method, options in METHODS:
        d = draft if method == "draft" else None
        on_engine = engine(method, options, llama, d, graphs=True, static=static)
        on, notes = answers(on_engine, greedy)
        answers(on_engine, greedy, PROMPTS[2:])       # another generation in between, then the first again:
        before = capture_seconds()                     # its steps replay the graphs recorded the first time
        again, _ = answers(on_engine, greedy)
        off, _ = answers(engine(method, options, llama, d, graphs=False, static=False), greedy)
        step = on_engine.target.static
        out.append({"check": "greedy", "model": "tiny llama", "method": method, "graphs_equal_no_graphs": on == off,
                    "equal_plain": on == plain, "again_equal": again == on,
                    "again_capture_s": round(capture_seconds() - before, 3),
                    "graphs_kept": len(step.graphs) if step else 0,
                    "graphs_off": bool(step and step.off), "warnings": notes})
    gemma = tiny_gemma3(seed=0).to(device)
    cfg = SamplingConfig(max_new_tokens=30)
    on, notes = answers(engine("ngram", {}, gemma, None, graphs=True, static=static), cfg)
    off, _ = answers(engine("ngram", {}, gemma, None, graphs=False, static=False), cfg)
    out.append({"check": "greedy past the sliding window", "model": "tiny gemma3", "method": "ngram",
                "graphs_equal_no_graphs": on == off, "warnings": notes})
    sampled = SamplingConfig(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, n=2)
    on, notes = answers(engine("draft", {}, llama, draft, graphs=True, static=static), sampled, PROMPTS[:2])
    off, _ = answers(engine("draft", {}, llama, draft, graphs=False, static=False), sampled, PROMPTS[:2])
    out.append({"check": "seeded sampling", "model": "tiny llama", "method": "draft",
                "graphs_equal_no_graphs": on == off, "warnings": notes})
    return out


def smollm2_shaped(dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_costs(model, device: str, graphs: bool, reps: int, context: int = 512) -> dict[int, float]:
    """ms per forward over n new tokens (a chain) after a `context`-token prefill, rolled back after each."""
    target = Target(model, cuda_graphs=graphs)
    kv = target.new_state(1)
    kv.reserve(context + 128)
    target.prefill(kv, [list(range(10, 10 + context))])
    costs = {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        tokens = torch.arange(n, device=device)[None] + 100
        positions = torch.arange(context, context + n, device=device)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
        start = kv.length
        times = []
        for i in range(reps + 3):                  # the first forwards of a shape capture its graph: not timed
            sync(device)
            t = time.perf_counter()
            target.forward(kv, tokens, positions, mask)
            sync(device)
            if i >= 3:
                times.append(time.perf_counter() - t)
            kv.keep(start, positions[:, :0], torch.zeros(1, dtype=torch.long, device=device))
        costs[n] = round(1000 * sorted(times)[len(times) // 2], 3)
    return costs


def decode_rate(model, graphs: bool, tokens: int = 256) -> float:
    eng = engine("plain", {}, model, None, graphs=graphs, static=False)
    cfg = SamplingConfig(max_new_tokens=tokens)
    eng.generate([list(range(10, 74))], SamplingConfig(max_new_tokens=16))      # warm up (captures)
    t = time.perf_counter()
    eng.generate([list(range(10, 74))], cfg)
    return round(tokens / (time.perf_counter() - t), 1)


def timings(device: str, reps: int) -> list[dict]:
    out = []
    dtypes = [torch.bfloat16, torch.float32] if device.startswith("cuda") else [torch.float32]
    for dtype in dtypes:
        model = smollm2_shaped(dtype, device)
        for graphs in ((True, False) if device.startswith("cuda") else (False,)):
            out.append({"check": "step cost", "model": "SmolLM2-135M shape, random", "dtype": str(dtype)[6:],
                        "graphs": graphs, "ms_per_forward_by_new_tokens": step_costs(model, device, graphs, reps),
                        "plain_tok_s": decode_rate(model, graphs)})
        del model
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON file for the results (also printed, one line each)")
    p.add_argument("--skip-timings", action="store_true")
    args = p.parse_args()
    results = [{"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                "torch": torch.__version__, "transformers": __import__("transformers").__version__}]
    for part in (lambda: exactness(args.device), lambda: [] if args.skip_timings else timings(args.device, args.reps)):
        try:
            for row in part():
                results.append(row)
                print(json.dumps(row), flush=True)
        except Exception as err:  # noqa: BLE001  (a program run once on a lent machine: report, then go on)
            import traceback
            traceback.print_exc()
            results.append({"error": f"{type(err).__name__}: {err}"[:2000]})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
