"""`spekit bench`: Spec-Bench questions through every spekit method that can run on the model and, on the same
prompts, the peers (Hugging Face generate; llama.cpp when installed). Prints a table, then one JSON line.
`--sweep KEY=V1,V2` (repeatable) with `--report DIR` adds sweeps, PNG plots and an offline HTML report."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from ..config import UserError, write_atomic
from ..bench.answers import check_writable
from ..bench.questions import load_questions, pick
from ..bench.runner import Settings, measure
from ..bench.summary import print_table


def add_bench_parser(sub) -> None:
    from .flags import add_backend_flags, add_method_flags, add_model_flags
    p = sub.add_parser("bench", help="benchmark methods side by side on Spec-Bench questions")
    add_model_flags(p)
    add_backend_flags(p)
    add_method_flags(p)
    for action in p._actions:              # bench's --method: that method against plain; --methods for a list
        if action.dest == "method":
            action.default, action.help = None, "one method to measure against plain (several: --methods); " \
                + action.help
    p.add_argument("--quick", action="store_true", help="short mode: 2 questions per category (unless --limit)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: "
                   "../shared/data/spec_bench/question.jsonl when present)")
    p.add_argument("--limit", "--per-category", dest="limit", type=int, default=None,
                   help="questions per category (default: all; 2 with --quick)")
    p.add_argument("--categories", default=None, help="comma-separated Spec-Bench groups (mt_bench, translation, "
                   "summarization, qa, math_reasoning, rag) or MT-bench categories (writing, coding ...)")
    p.add_argument("--methods", default=None, help="comma-separated spekit methods and peers (default: every "
                   "method of the registry and every peer; those that cannot run are listed as skipped); a method "
                   "with option values of its own is a contestant of its own: METHOD:OPTION=VALUE[:...], e.g. "
                   "rest,rest:tree-size=12 (its values over the flags')")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per answered turn (Spec-Bench's own scripts use "
                   "1024; a small model often loops to that limit, which lookup drafters reproduce cheaply)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's (the HF peers have none and are "
                   "skipped)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verification", choices=("block", "token"), default="block", help="how chains of sampled "
                   "drafts are verified (block: jointly, Sun et al. 2024; token: the textbook walk); both exact")
    p.add_argument("--relaxed", type=float, default=0.0, metavar="NATS", help="LOSSY, opt-in: accept draft "
                   "tokens within NATS of the target's best (0: off); the methods are marked lossy (*)")
    p.add_argument("--batch-size", type=int, default=1, help="questions decoded together (peers: one at a time)")
    p.add_argument("--hf-early-exit-layer", type=int, default=None,
                   help="exit layer of the hf-early-exit peer (default: half the layers)")
    p.add_argument("--lockstep", action="store_true",
                   help="the spekit methods and llama.cpp's peers answer each batch step by step in turn, so that a "
                   "shared machine's speed changes hit them alike (each timed on its own steps; the Hugging Face "
                   "peers still run one after another)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="use the chat template "
                      "(default when the model has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the turns as plain text")
    p.add_argument("--answers", default=None, help="folder for the Spec-Bench answer files (<method>.jsonl); "
                   "a stopped run resumes there (default: DIR/answers/base with --report, else not kept)")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    p.add_argument("--report", default=None, help="folder for run.json, PNG plots and report.html")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="vary one setting (batch, temperature, dtype, quantize, num_draft_tokens or any method "
                   "option); "
                   "repeatable; needs --report")
    p.add_argument("--sweep-limit", type=int, default=None,
                   help="questions per category in the sweeps (default: as --limit)")
    p.set_defaults(run=run_bench)


def settings_from(args: argparse.Namespace) -> Settings:
    from .flags import method_args
    return Settings(model=args.model, draft=args.draft, dtype=args.dtype, device=args.device,
                    quantize=args.quantize, compile=args.compile, cuda_graphs=args.cuda_graphs,
                    cost_profile=args.cost_profile,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, repetition_penalty=args.repetition_penalty,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                    seed=args.seed, verification=args.verification, relaxed=args.relaxed,
                    batch=args.batch_size, options=method_args(args),
                    early_exit_layer=args.hf_early_exit_layer, chat=args.chat,
                    lockstep=args.lockstep, backend=args.backend, draft_backend=args.draft_backend, ctx_size=args.ctx_size, threads=args.threads,
                    kernels=args.kernels, prefill=args.prefill_kernels)


def names_from(args: argparse.Namespace) -> list[str] | None:
    """The contestants asked for (None: every method and peer); --method M alone is M against plain."""
    if args.method is not None and args.methods is not None:
        raise UserError(f"give --method (one method against plain) or --methods (a list), not both: e.g. "
                        f"--methods plain,{args.method}")
    if args.method is not None:
        return list(dict.fromkeys(["plain", args.method]))
    if args.methods is None:
        return None
    names = [n.strip() for n in args.methods.split(",")]
    if not all(names):
        raise UserError(f"--methods {args.methods!r} has an empty name: give comma-separated names (e.g. "
                        "plain,ngram), or leave it out to run every method and peer")
    return names


def _check_options(options: dict, names: list[str] | None) -> None:
    """A method option (--depth, ...) that none of the methods run takes is a mistake, not something to ignore."""
    from ..proposers import REGISTRY
    from ..bench.variants import method_of
    run = list(dict.fromkeys(method_of(n) for n in (names or REGISTRY) if method_of(n) in REGISTRY))
    taken = {f.name for n in run for f in dataclasses.fields(REGISTRY[n].Options)}
    stray = sorted(set(options) - taken)
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise UserError(f"no method run here takes {flags} (methods: {', '.join(run) or 'none'})")


def run_bench(args: argparse.Namespace) -> None:
    from ..bench.contestants import split_names
    from ..bench.peers import PEERS
    from ..bench.sweep import check_values, parse_sweep, run_sweeps
    from ..bench.variants import check as check_variants
    # check everything before loading a model, and before the minutes of a run
    sweeps = [parse_sweep(spec) for spec in args.sweep]
    if sweeps and not args.report:
        raise UserError("--sweep needs --report DIR (where the plots and the HTML report go)")
    if args.sweep_limit is not None and args.sweep_limit < 1:
        raise UserError(f"--sweep-limit must be >= 1, got {args.sweep_limit}")
    names = names_from(args)
    split_names(names, PEERS)                                     # unknown names
    if args.hf_early_exit_layer is not None and names is not None and "hf-early-exit" not in names:
        raise UserError("--hf-early-exit-layer is for the hf-early-exit peer, which --methods does not name")
    settings = settings_from(args)
    _check_options(settings.options, names)
    check_variants(names or [], settings.options)
    settings.sampling()
    if settings.batch < 1:
        raise UserError(f"--batch-size must be >= 1, got {settings.batch}")
    check_values(settings, names, sweeps)
    report_dir = Path(args.report) if args.report else None
    answers_dir = args.answers or (report_dir / "answers" / "base" if report_dir else None)
    for path, what, folder in ((args.out, "--out", False), (report_dir, "--report", True),
                               (answers_dir, "--answers", True)):
        if path:
            check_writable(path, what, folder)
    limit = args.limit if args.limit is not None else (2 if args.quick else None)
    cats = args.categories.split(",") if args.categories else None
    questions = pick(load_questions(args.questions), limit, cats)
    swept = pick(load_questions(args.questions), args.sweep_limit, cats) if args.sweep_limit else questions
    report = measure(settings, questions, names, answers_dir)
    print_table(report, sys.stdout)
    command = "spekit " + " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or sys.argv[1:])
    report["command"] = command             # a record says what made it (`spekit advise --explain` quotes it)
    if report_dir:
        record = {"command": command, "base": report, "sweeps": run_sweeps(settings, swept, names, report_dir,
                                                                          sweeps)}
        write_record(record, report_dir)
        report["report"] = str(report_dir / "report.html")
    line = json.dumps(report)
    print(line)
    if args.out:
        write_atomic(args.out, line + "\n")


def write_record(record: dict, folder: Path) -> None:
    """run.json (what the trade-off report is generated from), the PNGs and report.html."""
    from ..bench.plots import make_plots
    from ..bench.report import write_html
    write_atomic(folder / "run.json", json.dumps(record, indent=1) + "\n")
    plots = make_plots(record, folder)
    write_html(record, plots, folder, folder / "report.html")
