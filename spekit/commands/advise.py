"""`spekit advise`: which method, which settings, for this model and these prompts. A short measured tournament
(every method that can run here at its defaults, then a few draft lengths; successive halving in lockstep with
plain) within a time budget, ranked by speedup over plain on the user's own prompts, then the exact command to
use. `--explain` prints the selection table used when nothing can be measured (spekit/commands/selection.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from ..bench.contestants import engine_steps
from ..bench.lockstep import lockstep
from ..config import SamplingConfig, UserError, text_or_file
from .flags import read_prompts
from ..proposers import REGISTRY
from ..proposers.cross_draft import CrossDraft


def candidates() -> list[tuple[str, dict]]:
    """(method, options): every registered method at its defaults, then shorter and longer drafts."""
    first = [("plain", {})] + [(m, {}) for m in sorted(REGISTRY) if m != "plain"]
    more = []
    for m in sorted(REGISTRY):
        fields = {f.name: f.default for f in dataclasses.fields(REGISTRY[m].Options)}
        if "num_draft_tokens" in fields:
            n = fields["num_draft_tokens"]
            more += [(m, {"num_draft_tokens": k}) for k in sorted({max(1, n // 2), n * 2}) if k != n]
    return first + more


def added_bytes(obj, target_model: torch.nn.Module | None) -> int:
    """Bytes of tensors a proposer holds beyond the target's own weights (draft model, heads, buffers); target_model
    None: a target whose weights are not torch tensors (llama.cpp), none of whose bytes are counted."""
    own = set() if target_model is None else \
        {t.data_ptr() for t in list(target_model.parameters()) + list(target_model.buffers())}
    seen, total, stack = set(), 0, [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if id(x) in seen or depth > 4:
            continue
        seen.add(id(x))
        if isinstance(x, torch.nn.Module):
            tensors = list(x.parameters()) + list(x.buffers())
        elif isinstance(x, torch.Tensor):
            tensors = [x]
        elif isinstance(x, np.ndarray):        # a datastore's tokens and index (rest)
            total += x.nbytes
            continue
        else:
            items = (x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple))
                     else vars(x).values() if hasattr(x, "__dict__") and type(x).__module__.startswith("spekit")
                     else [])
            stack += [(v, depth + 1) for v in items]
            continue
        for t in tensors:
            if t.data_ptr() not in own and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _build(base, draft) -> tuple[dict, dict[str, str]]:
    """{label: (method, options, Spekit)} for the candidates that can run here; {label: reason} for the others."""
    built, skipped = {}, {}
    for method, opts in candidates():
        label = method + "".join(f" {k}={v}" for k, v in opts.items())
        try:
            built[label] = (method, opts, base if method == "plain" else base.with_method(
                method, draft if REGISTRY[method].needs_draft_model else None, **opts))
        except UserError as err:
            skipped[label] = str(err)
    return built, skipped


def tournament(base, draft, prompts: list[list[int]], batch: int, budget_s: float, cfg: SamplingConfig):
    """Rows {method, options, label, tok_s, speedup, tau, prompts, added_mb, identical} ranked by speedup; and
    {label: reason} for candidates that cannot run here (the budget only limits how many batches are answered).

    Successive halving in lockstep (spekit.bench.lockstep): every candidate answers the first batch of prompts
    together with plain, step by step in turn, so that the machine's drifts hit all alike; after each batch the
    slower half leaves, and the rest answer the next batch, while the budget lasts. A candidate's speedup is plain's
    time over its own on the prompts it answered."""
    start = time.perf_counter()
    built, skipped = _build(base, draft)
    warm = dataclasses.replace(cfg, max_new_tokens=4)       # first forwards and cost calibration are slow
    for _, _, sk in tqdm(built.values(), desc="advise: warm-up", unit="setting", file=sys.stderr, leave=False):
        sk.engine.generate(prompts[:1], warm)
        sk.engine.proposer.forget()          # the warm-up's text is not to be drafted from when prompt 1 is timed
    figures = {label: {"own_s": 0.0, "plain_s": 0.0, "tokens": 0, "forwards": 0, "outputs": {}, "draft_s": 0.0,
                       "verify_s": 0.0, "offered": [], "accepted": []} for label in built}
    playing = list(built)                                             # plain first
    batches = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    bar = tqdm(batches, desc="advise", unit="batch", file=sys.stderr, leave=False)
    for k, rows in enumerate(bar):
        bar.set_postfix_str(f"{len(playing)} settings")
        round_start = time.perf_counter()
        with base.target.sharing_prefills():          # one prefill, its time charged to each (Target.prefilled)
            got = lockstep({label: engine_steps(built[label][2].engine)([prompts[i] for i in rows], cfg)
                            for label in playing})
        plain_s = sum(o.charged_s for o in got["plain"])
        for label in playing:
            f = figures[label]
            f["own_s"] += sum(o.charged_s for o in got[label])
            f["plain_s"] += plain_s
            f["tokens"] += sum(len(o.token_ids) for o in got[label])
            f["forwards"] += sum(o.forwards or 0 for o in got[label])
            f["outputs"].update(zip(rows, (o.token_ids for o in got[label])))
            for o in got[label]:
                f["draft_s"] += o.draft_s or 0.0
                f["verify_s"] += o.verify_s or 0.0
                f["offered"] = _added(f["offered"], o.offered)
                f["accepted"] = _added(f["accepted"], o.accepted)
        others = sorted(playing[1:], key=lambda lb: figures[lb]["own_s"] / figures[lb]["plain_s"])
        playing = ["plain"] + others[: (len(others) + 1) // 2]
        took = time.perf_counter() - round_start
        if k + 1 < len(batches) and time.perf_counter() - start + took * len(playing) / len(got) > budget_s:
            break
    bar.close()
    plain_out = figures["plain"]["outputs"]
    out = []
    for label, (method, opts, sk) in built.items():
        f = figures[label]
        out.append({"method": method, "options": opts, "label": label,
                    "tok_s": round(f["tokens"] / f["own_s"], 2) if f["own_s"] else 0.0,
                    "speedup": round(f["plain_s"] / f["own_s"], 3) if f["own_s"] else 0.0,
                    "tau": round(f["tokens"] / max(f["forwards"], 1), 3), "prompts": len(f["outputs"]),
                    "added_mb": round(added_bytes(sk.engine.proposer, base.loaded.model) / 2**20, 1),
                    "lossless": REGISTRY[method].lossless,
                    "identical": all(plain_out[i] == o for i, o in f["outputs"].items()) if cfg.greedy else None,
                    "drafting": _drafting(f, sk) if REGISTRY[method].needs_draft_model else None})
    out.sort(key=lambda r: (-r["prompts"], -r["speedup"]))      # the last round's survivors first
    return out, skipped


def _added(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _drafting(f: dict, sk) -> dict:
    """What a draft model cost and returned on these prompts: its seconds per drafted token against a target
    forward's (both measured), the acceptance by draft position, and whether its vocabulary is the target's."""
    drafted = sum(f["offered"])
    per_forward = f["verify_s"] / max(f["forwards"], 1)
    return {"cost_ratio": round(f["draft_s"] / drafted / per_forward, 3) if drafted and per_forward else None,
            "acceptance": [round(a / o, 2) for a, o in zip(f["accepted"], f["offered"]) if o][:4],
            "drafted": drafted, "other_vocabulary": isinstance(sk.engine.proposer, CrossDraft)}


def _drafting_line(r: dict) -> str:
    """Why a draft model paid or not here, from what it cost and returned on these prompts."""
    d = r["drafting"]
    kind = "of another vocabulary (through the text)" if d["other_vocabulary"] else "of the same vocabulary"
    if not d["drafted"]:
        return (f"     {r['label']}: the draft model {kind} drafted nothing: on these prompts the pacer found no "
                "draft length that pays for its forwards and the wider verification")
    accept = " ".join(f"{a:.2f}" for a in d["acceptance"])
    cost = f"{d['cost_ratio']:.2f}" if d["cost_ratio"] is not None else "?"
    return (f"     {r['label']}: the draft model {kind} costs {cost} of a target forward a drafted token "
            f"(measured); accepted by position {accept}: a draft pays where its acceptance well exceeds that cost "
            f"ratio ({r['speedup']:.2f}x here)")


def commands(best: dict, args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model] + (["--dtype", args.dtype] if args.dtype != "float32" else [])
    flags += (["--quantize", args.quantize] if args.quantize != "none" else []) + (["--compile"] if args.compile else []) \
        + ([] if getattr(args, "cuda_graphs", True) else ["--no-cuda-graphs"]) \
        + ([] if getattr(args, "cost_profile", "auto") == "auto" else ["--cost-profile", args.cost_profile])
    if getattr(args, "backend", "torch") != "torch":
        flags += ["--backend", args.backend] + (["--kernels", args.kernels] if args.kernels != "exact" else []) \
            + ([] if getattr(args, "prefill_kernels", "fast") == "fast"
               else ["--prefill-kernels", args.prefill_kernels])
    if best["method"] != "plain":
        flags += ["--method", best["method"]]
    if REGISTRY[best["method"]].needs_draft_model:
        flags += ["--draft", args.draft]
        if getattr(args, "draft_backend", "same") != "same":
            flags += ["--draft-backend", args.draft_backend]
    for k, v in best["options"].items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    quoted = " ".join(shlex.quote(f) for f in flags)
    grammar = [f for name in ("json_schema", "regex") if getattr(args, name, "")
               for f in ("--" + name.replace("_", "-"), getattr(args, name))]
    held = "".join(" " + shlex.quote(f) for f in grammar)
    return [f"spekit generate {quoted} --max-new-tokens {args.max_new_tokens}{held} 'YOUR PROMPT'",
            f"spekit serve {quoted}"]


def add_advise_parser(sub) -> None:
    from .flags import add_backend_flags, add_model_flags
    p = sub.add_parser("advise", help="measure the methods on your prompts and print the command to use")
    add_model_flags(p)
    add_backend_flags(p)
    p.add_argument("--prompts", default=None, help="a text file (one prompt a line) or .jsonl (turns/prompt/text)")
    p.add_argument("--draft", default=None, help="a draft model to include the draft method")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=120.0, help="time budget of the tournament: every candidate "
                   "warms up and answers the first batch of prompts whatever it says; later batches are played "
                   "while it lasts (default 120)")
    p.add_argument("--max-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", default="", metavar="JSON|@FILE", help="measure with answers held to this "
                         "JSON schema (structured output), as your requests will be")
    grammar.add_argument("--regex", default="", help="measure with answers held to this regular expression")
    p.add_argument("--explain", action="store_true", help="print the selection table (situation -> method, why, "
                   "and each method's figures in the latest recorded benchmark)")
    p.add_argument("--record", default=None, metavar="FILE", help="with --explain: quote this `spekit bench --out` "
                   "record instead of the shipped one of its backend")
    p.set_defaults(run=run_advise)


def runnable_candidates() -> list[tuple[str, dict]]:
    """The candidates a llama.cpp target can run (those needing hidden states or the target's layers are not)."""
    from ..backends.llama_model import refusal
    return [(m, o) for m, o in candidates() if refusal(REGISTRY[m]) is None]


def _draft(args: argparse.Namespace, base):
    """--draft on --draft-backend (by default the base's)."""
    from ..backends.loading import load_draft
    return load_draft(args.draft, base.target, args.draft_backend, args.dtype, args.device, args.quantize)


def run_advise(args: argparse.Namespace) -> None:
    if args.explain:
        from .selection import RECORDS, backend_of, explain, read_record
        records = dict(RECORDS)
        if args.record:
            records[backend_of(read_record(args.record))] = args.record
        explain(records=records)
        return
    if not args.prompts:
        raise UserError("advise needs --prompts FILE (or --explain for the selection table)")
    if args.batch_size < 1 or args.max_prompts < 1:
        raise UserError("--batch-size and --max-prompts must be >= 1")
    if not 0 < args.budget_s < math.inf:                         # nan fails it too
        raise UserError(f"--budget-s must be a finite number of seconds > 0, got {args.budget_s}")
    prompts = read_prompts(args.prompts, args.max_prompts)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         json_schema=text_or_file(args.json_schema, "--json-schema"), regex=args.regex)
    from ..backends.loading import choose
    from .flags import load_spekit
    on_llama = choose(args.backend, args.model) == "llama.cpp"
    # in lockstep every candidate's rows are alive at once: on llama.cpp each needs its own sequences
    rows = args.batch_size * (len(runnable_candidates()) if on_llama else 1)
    base = load_spekit(args, "plain", rows=rows)
    draft = _draft(args, base) if args.draft else None
    ids = [base.encode(p) for p in prompts]
    rows, skipped = tournament(base, draft, ids, args.batch_size, args.budget_s, cfg)
    held = ", answers held to the JSON schema" if cfg.json_schema else ", answers held to the regex" if cfg.regex \
        else ""
    print(f"{len(prompts)} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, temperature "
          f"{args.temperature}{held}")
    print(f"{'rank':<5}{'method':<36}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'+MB':>8}{'prompts':>9}  same as plain")
    for i, r in enumerate(rows, 1):
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        print(f"{i:<5}{r['label']:<36}{r['tok_s']:>8.1f}{r['speedup']:>8.2f}x{r['tau']:>7.2f}{r['added_mb']:>8.1f}"
              f"{r['prompts']:>9}  {same}")
    for label, why in skipped.items():
        print(f"     skipped {label}: {why}")
    for r in rows:
        if r["drafting"]:
            print(_drafting_line(r))
    plain = next(r for r in rows if r["method"] == "plain")
    fit = [r for r in rows if r["lossless"] and r["identical"] is not False and r["speedup"] > 1.0]
    best = fit[0] if fit else plain
    print(f"\nuse {best['label']} ({best['speedup']:.2f}x over plain on these prompts):")
    for line in commands(best, args):
        print("  " + line)
    print(json.dumps({"best": {k: best[k] for k in ("method", "options", "speedup", "tau", "added_mb")},
                      "ranking": [{k: r[k] for k in ("label", "tok_s", "speedup", "tau", "added_mb", "prompts", "identical",
                                                     "drafting")}
                                  for r in rows], "skipped": skipped, "commands": commands(best, args)}))
