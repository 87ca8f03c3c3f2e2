"""`spekit train KIND`: distill (cached), extract features (cached), train, measure tau on held-out prompts with
the real engine and method, save. The kind -> method map is KIND_METHOD; a kind whose method is not registered
gets tau = null (said in the log)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch

from ..config import SamplingConfig, UserError
from ..backends.torch_models import dtype_name

KIND_METHOD = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle3", "draft": "draft", "mtp": "mtp",
               "exit": "early-exit"}


def split(records: list[dict], held_out: int, seed: int) -> tuple[set[str], list[dict]]:
    """(training record ids, held-out records): a seeded choice of `held_out` records kept out of training."""
    order = sorted(records, key=lambda r: r["id"])
    random.Random(seed).shuffle(order)
    return {r["id"] for r in order[held_out:]}, order[:held_out]


def one_by_one(engine, prompts: list[list[int]], cfg: SamplingConfig) -> list:
    """The engine's results for each prompt decoded alone, in order."""
    return [r for prompt in prompts for r in engine.generate([prompt], cfg)]


def measure_tau(sk, method: str, prompts: list[list[int]], max_new_tokens: int, draft=None,
                forced: dict | None = None, **options) -> dict:
    """Greedy tau (new tokens per target forward) of `method` over these prompts, and whether every output equals
    plain greedy decoding's. One prompt at a time: tau is the field's batch-1 figure, and a static batch of rows
    with equal budgets drafts little by design (pacing.pacer.MOST_BEHIND), which would hide what the drafter can do.

    forced: method options that make it draft its full depth whatever drafting costs (a head's
    `acceptance_options`), with the engine's governor off: tau is then the drafter's acceptance, not what pays on
    this machine in this dtype (drafting MTP modules rarely pays in float32 on a CPU, and tau would read 1.0)."""
    from ..proposers import REGISTRY
    if method not in REGISTRY:
        print(f"[spekit] method '{method}' is not registered in this build: tau not measured", file=sys.stderr)
        return {"tau": None, "tau_note": f"method '{method}' not registered"}
    cfg = SamplingConfig(max_new_tokens=max_new_tokens)
    plain = one_by_one(sk.engine, prompts, cfg)
    spec = sk.with_method(method, draft, **options, **(forced or {}))
    spec.engine.pacer.governed = not forced
    results = one_by_one(spec.engine, prompts, cfg)
    tokens = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    same = all(a.token_ids == b.token_ids for a, b in zip(plain, results))
    return {"tau": round(tokens / max(forwards, 1), 4), "tau_prompts": len(prompts),
            "tau_new_tokens": max_new_tokens, "tau_dtype": dtype_name(sk.target.dtype), "identical_to_plain": same,
            **({"tau_forced": forced} if forced else {})}


def _head_options(args: argparse.Namespace) -> dict:
    from .folders import HEAD_DEST
    return {k[len(HEAD_DEST):]: (tuple(v) if isinstance(v, list) else v) for k, v in vars(args).items()
            if k.startswith(HEAD_DEST) and v is not None}


def _check_head_options(args: argparse.Namespace) -> None:
    """The head flags' own checks (ranges; what --init keeps), which need no model: before it loads."""
    given = _head_options(args)
    if not getattr(args, "init", None):       # the fields the target gives (its shape) filled with placeholders
        shape = {f.name: 1 for f in dataclasses.fields(args.head_class.Config) if f.default is dataclasses.MISSING}
        args.head_class.Config(**shape, **given)
        return
    if args.head_class.kind == "draft":
        from .draft import read_draft_config
        read_draft_config(args.init)                 # a folder that holds no draft fails here, before the model
    else:
        from ..heads.base import read_config
        found = read_config(args.init)["kind"]       # a folder without a head's config fails here, before the model
        if found != args.head_class.kind:
            raise UserError(f"--init {args.init} holds a '{found}' head, not '{args.head_class.kind}'")
    fixed = sorted(set(given) - args.head_class.reconfigurable)
    if fixed:
        raise UserError(f"--init {args.init} keeps that head's own config; drop "
                        f"{', '.join('--' + k.replace('_', '-') for k in fixed)}")


def _initial_head(args: argparse.Namespace, target):
    """A fresh head with the flags' options, or (--init DIR) the trained head in DIR, in float32 for training."""
    if not getattr(args, "init", None):
        return args.head_class.create(target, **_head_options(args))
    from ..heads.base import load_head
    given = _head_options(args)
    if args.head_class.kind == "draft":
        return args.head_class.load(args.init, target, **given)
    head = load_head(args.init, target, args.head_class.kind)
    if given:
        head = head.reconfigured(**given).to(device=target.device)
    shared = {p.data_ptr() for p in target.model.parameters()}
    for p in head.parameters():      # its own weights to float32; tensors shared with the target keep their type
        if p.data_ptr() not in shared:
            p.data = p.data.float()
    return head


def train_command(args: argparse.Namespace, command: str) -> dict:
    from accelerate import Accelerator
    from ..api import Spekit
    from ..backends.torch_models import load_model
    from .folders import check_data_flags, data_dir, distill_data, training_records, work_dir
    from .distill import read_answers
    from .features import FeatureStore
    from .trainer import TrainConfig, Trainer

    out = Path(args.out)
    check_data_flags(args, args.head_class.kind)
    _check_head_options(args)
    records = training_records(args)          # bad input fails before the model loads
    cfg = TrainConfig(args.steps, args.batch_tokens, args.lr, args.warmup, args.weight_decay, args.clip,
                      args.checkpoint_every, args.seed)
    if not 0 <= args.held_out < len(records):
        raise UserError(f"--held-out must be in [0, {len(records) - 1}] for {len(records)} prompts")
    acc = Accelerator(cpu=args.device == "cpu", mixed_precision=args.mixed_precision)
    device = str(acc.device) if args.device != "cpu" else "cpu"
    fast = args.fast_answers
    sk = Spekit.load(args.model, "plain", None, args.dtype, device, args.quantize, args.compile, exact=not fast)
    head = _initial_head(args, sk.target)      # --init trained for another model fails before the distillation
    if acc.is_main_process:
        data = distill_data(args, sk)
    acc.wait_for_everyone()
    if fast:      # answered with the model's own kernels; the features and the held-out tau take the exact forms
        sk = Spekit(sk.loaded, "plain", compile=args.compile)
    data = data_dir(args)
    train_ids, held = split(records, args.held_out, args.seed)
    answers = read_answers(data)
    store = FeatureStore(data, answers, sk.target, max_len=args.max_len)
    usable = [n for n, _, _ in store.sequences if n.split("/")[0] in train_ids]
    trainer = Trainer(head, sk.target, store, usable, cfg, work_dir(args), acc)
    resumed = args.resume and trainer.load_checkpoint()
    if args.resume and not resumed:
        print(f"[spekit] no checkpoint in {work_dir(args)}: starting from step 0", file=sys.stderr)
    fresh = not resumed and not args.init
    if hasattr(head, "choose_vocab") and (fresh or not getattr(head, "vocab_chosen", True)):
        head.choose_vocab(trainer.token_counts())
    if hasattr(head, "init_from_target") and fresh:
        head.init_from_target(sk.target)
    figures = trainer.train()
    if not acc.is_main_process:
        return {}
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model   # export finds a folder
    meta = {"tau": None, "command": command, "target": model, "trained_on": str(args.prompts),
            "steps": trainer.step, "sequences": len(usable),
            **({"initialised_from": str(args.init)} if args.init else {}),
            "figures": {k: round(v, 4) for k, v in figures.items()}}
    if hasattr(head, "measured_meta"):     # e.g. Medusa's top-k accuracies, from which its static tree is built
        held_names = [n for n, _, _ in store.sequences if n.split("/")[0] not in train_ids] or usable[:16]
        meta.update(head.measured_meta(store.batch(held_names, head.training_layers(), acc.device), sk.target))
    by_id = {r["id"]: r for r in answers}
    prompts = [by_id[r["id"]]["prompt_ids"] for r in held if r["id"] in by_id]
    method = KIND_METHOD.get(head.kind, head.kind)
    _save(head, out, args, meta, sk)
    if prompts:
        if head.kind == "draft":
            draft = load_model(str(out), args.dtype, device)
            meta.update(measure_tau(sk, "draft", prompts, args.eval_tokens, draft))
        else:
            meta.update(measure_tau(sk, method, prompts, args.eval_tokens, heads=str(out),
                                    forced=head.acceptance_options()))
        _save(head, out, args, meta, sk)
    print(json.dumps({"kind": head.kind, "out": str(out), **meta}))
    return meta


def _save(head, out: Path, args, meta: dict, sk) -> None:
    from ..heads.base import save_head
    from .draft import save_draft
    if head.kind == "draft":
        model = args.model if not Path(args.model).exists() else str(Path(args.model).resolve())
        save_draft(head, out, model, meta, tokenizer=sk.tokenizer, standalone=args.standalone,
                   dtype=getattr(torch, args.save_dtype))
    else:
        save_head(head, out, meta, getattr(torch, args.save_dtype))
