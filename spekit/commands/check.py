"""`spekit check --method M --heads DIR --prompts FILE`: are these heads still aligned with this model?

Decodes the user's prompts greedily with the method, reports τ (new tokens per target forward) and the acceptance
rate at each draft depth, and warns, with the numbers, when τ falls well below the τ recorded when the heads
were trained (config.json meta.tau): the sign of a target fine-tuned after its heads were trained.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import SamplingConfig, UserError, read_user_text
from ..backends.torch_models import dtype_name

DRIFT = 0.8    # warn when τ < DRIFT x the τ recorded at training


def read_prompts(path: str | Path) -> list[str]:
    """One prompt a line, or JSONL records with "turns" (the first turn is used), "prompt" or "text"."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"prompt file {path} does not exist")
    prompts = []
    for i, line in enumerate(read_user_text(path, "prompt file").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{i}: not valid JSON ({err})") from None
            turns = rec.get("turns")
            if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
                raise UserError(f"{path}:{i}: 'turns' must be a list of strings")
            text = (turns or [None])[0] or rec.get("prompt") or rec.get("text")
            if not isinstance(text, str):
                raise UserError(f"{path}:{i}: a record needs 'turns', 'prompt' or 'text'")
            prompts.append(text)
        else:
            prompts.append(line)
    if not prompts:
        raise UserError(f"{path} holds no prompt")
    return prompts


def drift_report(results, recorded: float | None) -> dict:
    """τ, per-depth acceptance over all results, and the drift verdict against the recorded τ (None: nothing
    comparable recorded)."""
    tokens = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    depth = max((len(r.stats.position_offered) for r in results), default=0)
    offered = [sum(r.stats.position_offered[d] for r in results if d < len(r.stats.position_offered))
               for d in range(depth)]
    accepted = [sum(r.stats.position_accepted[d] for r in results if d < len(r.stats.position_accepted))
                for d in range(depth)]
    tau = tokens / max(forwards, 1)
    drifted = recorded is not None and tau < DRIFT * recorded
    return {"tau": round(tau, 3), "recorded_tau": recorded, "drifted": drifted, "prompts": len(results),
            "position_acceptance": [round(a / o, 3) if o else 0.0 for a, o in zip(accepted, offered)]}


def add_check_parser(sub) -> None:
    from .flags import add_model_flags
    p = sub.add_parser("check", help="measure tau and per-position acceptance of trained heads on your prompts, "
                                     "and warn when they drifted from the tau recorded at training")
    add_model_flags(p)
    p.add_argument("--method", required=True, help="a method that drafts with heads (eagle, eagle3, medusa ...)")
    p.add_argument("--heads", required=True, help="the head directory")
    p.add_argument("--prompts", required=True, help="text file (one prompt a line) or JSONL")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    from ..api import Spekit
    from ..heads import read_config
    if args.limit < 0:
        raise UserError(f"--limit must be >= 0 (0 = all prompts), got {args.limit}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    info = read_config(args.heads)
    meta = info["meta"]
    recorded, forced, recorded_dtype = meta.get("tau"), meta.get("tau_forced") or {}, meta.get("tau_dtype")
    if not isinstance(recorded, (int, float, type(None))) or not isinstance(forced, dict):
        raise UserError(f"{args.heads}/config.json: meta.tau must be a number and meta.tau_forced an object")
    prompts = read_prompts(args.prompts)
    if args.limit > 0:
        prompts = prompts[: args.limit]
    sk = Spekit.load(args.model, args.method, None, args.dtype, args.device, args.quantize, args.compile,
                     cuda_graphs=args.cuda_graphs, cost_profile=args.cost_profile, heads=args.heads, **forced)
    sk.engine.pacer.governed &= not forced      # measured as recorded: forced to draft, the drafter's acceptance
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    # one prompt at a time, as tau is measured at training (train.run.measure_tau): a static batch of rows with
    # equal budgets drafts little by design
    gens = [g for prompt in prompts for g in sk.generate([prompt], cfg)]
    # a tree sized by this dtype's costs: a tau recorded in another dtype is no yardstick (bfloat16's wider trees)
    other = recorded_dtype is not None and recorded_dtype != dtype_name(sk.target.dtype)
    report = drift_report([g.result for g in gens], None if other else recorded)
    report.update(recorded_tau=recorded, recorded_dtype=recorded_dtype)
    acc = " ".join(f"{a:.2f}" for a in report["position_acceptance"])
    at = f" in {recorded_dtype}" if recorded_dtype else ""
    print(f"{args.method} heads {args.heads}: tau {report['tau']:.2f} on {len(prompts)} prompts "
          f"(recorded at training{at}: {recorded if recorded is not None else 'none'}); acceptance by depth: {acc}"
          + (f" (drafting forced, as recorded: {forced})" if forced else ""))
    if other:
        print(f"spekit: the recorded tau was measured in {recorded_dtype}, where the drafts are sized by other "
              f"costs: run with --dtype {recorded_dtype} to compare", file=sys.stderr)
    if report["drifted"]:
        print(f"spekit: warning: tau {report['tau']:.2f} is below {DRIFT:.0%} of the {recorded:.2f} recorded at "
              f"training: the heads fit this model or these prompts much worse than the held-out prompts they were "
              f"measured on (was the model fine-tuned, or are these prompts unlike the training ones?); retrain "
              f"them on your prompts with `spekit train {info['kind']} --init {args.heads} --prompts FILE`",
              file=sys.stderr)
    print(json.dumps(report))
    return 0
