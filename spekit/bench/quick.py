"""`spekit bench --quick`: a few Spec-Bench questions per category through spekit's methods and, in the same
run on the same prompts, Hugging Face's own `generate` (plain, prompt lookup, assistant model). Prints a table,
then one JSON line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..config import SamplingConfig, UserError
from .questions import load_questions, pick

HF_PEERS = {"hf-plain": {}, "hf-lookup": {"prompt_lookup_num_tokens": 10}, "hf-assistant": None}


@dataclass
class Run:
    method: str
    category: str
    question_id: int
    token_ids: list[int]
    wall_s: float
    forwards: int | None          # target forwards (None where the peer does not say)


def add_bench_parser(sub) -> None:
    from ..cli import add_method_flags, add_model_flags
    p = sub.add_parser("bench", help="benchmark methods side by side on Spec-Bench questions")
    add_model_flags(p)
    add_method_flags(p)
    p.add_argument("--quick", action="store_true", help="a few questions per category (the only mode so far)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: "
                   "../shared/data/spec_bench/question.jsonl when present)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--categories", default=None, help="comma-separated (default: all)")
    p.add_argument("--methods", default=None, help="comma-separated spekit methods and peers "
                   "(default: plain,ngram[,draft],hf-plain,hf-lookup[,hf-assistant])")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(run=run_bench)
    p.add_argument("--out", default=None, help="also write the JSON report to this file")


def run_bench(args: argparse.Namespace) -> None:
    from ..api import Spekit
    from ..cli import method_args
    from ..models import load_model
    questions = pick(load_questions(args.questions), args.per_category,
                     args.categories.split(",") if args.categories else None)
    methods = (args.methods.split(",") if args.methods else
               ["plain", "ngram"] + (["draft"] if args.draft else []) + ["hf-plain", "hf-lookup"]
               + (["hf-assistant"] if args.draft else []))
    if "plain" not in methods:
        methods.insert(0, "plain")
    base = Spekit.load(args.model, "plain", None, args.dtype, args.device)
    draft = load_model(args.draft, args.dtype, args.device) if args.draft else None
    # the peers get their own stock copies: spekit switches its models' linear layers to faster forms
    stock = load_model(args.model, args.dtype, args.device) if any(m in HF_PEERS for m in methods) else None
    stock_draft = load_model(args.draft, args.dtype, args.device) if args.draft and "hf-assistant" in methods else None
    runners = {m: _runner(m, base, draft, method_args(args), stock, stock_draft) for m in methods}
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    prompts = [(q, base.encode(q["turns"][0])) for q in questions]
    for run in runners.values():                      # warm-up: first forwards are slow
        run(prompts[0][1], SamplingConfig(max_new_tokens=8))
    runs: list[Run] = []
    for q, ids in tqdm(prompts, desc="bench", unit="question", file=sys.stderr):
        for name, run in runners.items():
            tokens, wall, forwards = run(ids, cfg)
            runs.append(Run(name, q["category"], q["question_id"], tokens, wall, forwards))
    report = summarize(runs, methods)
    report.update(model=args.model, dtype=args.dtype, device=args.device, max_new_tokens=args.max_new_tokens,
                  questions_per_category=args.per_category, torch_threads=torch.get_num_threads())
    print_table(report)
    line = json.dumps(report)
    print(line)
    if args.out:
        _write_atomic(args.out, line + "\n")


def _runner(name: str, base, draft, options: dict, stock, stock_draft):
    """A callable (ids, cfg) -> (new token ids, wall seconds, target forwards or None)."""
    if name in HF_PEERS:
        return _hf_runner(name, stock, stock_draft, base.engine.stop_ids)
    if name == "draft" and draft is None:
        raise UserError("method 'draft' needs --draft")
    from ..api import method_options
    from ..proposers import get
    takes = {f for f in get(name).Options.__dataclass_fields__}
    sk = base if name == "plain" else base.with_method(name, draft if name == "draft" else None,
                                                        **{k: v for k, v in options.items() if k in takes})

    def run(ids, cfg):
        result = sk.engine.generate([ids], cfg)[0]
        return result.token_ids, result.stats.wall_s, result.stats.target_forwards
    return run


def _hf_runner(name: str, stock, stock_draft, stop_ids):
    """Hugging Face's own generate on an untouched copy of the model."""
    model, tok = stock.model, stock.tokenizer
    extra = HF_PEERS[name]
    if extra is None:
        if stock_draft is None:
            raise UserError("hf-assistant needs --draft")
        extra = {"assistant_model": stock_draft.model}
    stop = list(stop_ids) or None

    def run(ids, cfg):
        x = torch.tensor([ids], device=model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                 do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id or 0, **extra)
        wall = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), wall, None
    return run


def summarize(runs: list[Run], methods: list[str]) -> dict:
    """Per method and category: tok/s (total tokens / total time), speedup over spekit plain and HF plain in the
    same category, tau, and the share of prompts whose output equals spekit plain's."""
    plain_out = {r.question_id: r.token_ids for r in runs if r.method == "plain"}
    cats = list(dict.fromkeys(r.category for r in runs)) + ["overall"]
    table: dict = {}
    for m in methods:
        table[m] = {}
        for c in cats:
            sel = [r for r in runs if r.method == m and (c == "overall" or r.category == c)]
            tokens, wall = sum(len(r.token_ids) for r in sel), sum(r.wall_s for r in sel)
            fwd = [r.forwards for r in sel if r.forwards is not None]
            table[m][c] = {
                "tok_s": round(tokens / wall, 2) if wall else 0.0,
                "tau": round(tokens / sum(fwd), 3) if fwd and len(fwd) == len(sel) else None,
                "identical": round(sum(r.token_ids == plain_out[r.question_id] for r in sel) / len(sel), 3),
                "prompts": len(sel), "new_tokens": tokens}
    for m in methods:
        for c in cats:
            row = table[m][c]
            row["speedup"] = round(row["tok_s"] / table["plain"][c]["tok_s"], 3)
            if "hf-plain" in table:
                row["speedup_vs_hf_plain"] = round(row["tok_s"] / table["hf-plain"][c]["tok_s"], 3)
    return {"bench": "quick", "categories": cats, "results": table}


def print_table(report: dict) -> None:
    cats, res = report["categories"], report["results"]
    print(f"model {report['model']}  dtype {report['dtype']}  max_new_tokens {report['max_new_tokens']}  "
          f"greedy  bs=1  ({report['questions_per_category']} questions per category)")
    print("tok/s  (speedup over spekit plain | tau | share identical to plain)")
    print(f"{'method':<14}" + "".join(f"{c:>24}" for c in cats))
    for m, row in res.items():
        cells = []
        for c in cats:
            r = row[c]
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            cells.append(f"{r['tok_s']:6.1f} ({r['speedup']:.2f}x|{tau}|{r['identical']:.0%})")
        print(f"{m:<14}" + "".join(f"{x:>24}" for x in cells))


def _write_atomic(path: str, text: str) -> None:
    import os
    import tempfile
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-bench-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
