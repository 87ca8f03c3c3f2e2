"""`spekit train ...`:
    spekit train prompts --out FILE --count N            build training prompts (no Spec-Bench text)
    spekit train prompts --self-instruct --model M ...    or let the model write them (Magpie-style)
    spekit train distill --model M --prompts FILE --out DIR    the target answers them (cached, resumable)
    spekit train KIND --model M --prompts FILE --out DIR       train a head (every kind in spekit.heads.HEADS)
                                                               or a draft model (kind `draft`)
    spekit train rest --model M --prompts FILE --out DIR       build the datastore of --method rest
    spekit train rest --model M --texts LOGS --out DIR         ... from texts the model wrote before
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from ..config import UserError
from ..train.folders import HEAD_DEST, check_data_flags, distill_data, training_records


def add_train_parser(sub) -> None:
    from ..heads import HEADS
    from .flags import add_model_flags
    from ..train.draft import DraftHead

    p = sub.add_parser("train", help="build training prompts, distill answers, train heads / draft models")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{prompts,distill," +
                             ",".join(sorted([*HEADS, "draft", "rest"])) + "}")
    pr = kinds.add_parser("prompts", help="write training prompts built from this machine's material (JSONL)")
    pr.add_argument("--out", required=True)
    pr.add_argument("--count", type=int, default=1200)
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--passages", default=None, metavar="FILE",
                    help="documents to summarise and answer from instead of Python's reference prose "
                    "(a texts file: blocks separated by blank lines, or JSONL records with a \"text\"); "
                    "e.g. the target's own earlier answers: python scripts/answer_texts.py DATA --out FILE")
    pr.add_argument("--catalogs", action="store_true",
                    help="translation prompts from the German, French and Spanish sentences of the machine's "
                    "gettext catalogs (/usr/share/locale) besides the template sentences")
    pr.add_argument("--categories", default=None, metavar="A,B",
                    help="only these of the thirteen categories (default: all, by their weights)")
    pr.add_argument("--self-instruct", action="store_true",
                    help="let --model write the requests: its user turn is sampled from its chat template "
                    "(Magpie), giving the kinds and topics of its own instruction tuning")
    add_model_flags(pr)
    pr.set_defaults(run=run_prompts)
    d = kinds.add_parser("distill", help="the target answers the prompts (greedy, cached, resumable)")
    add_model_flags(d)
    _data_flags(d)
    _fast_answers_flag(d)
    d.set_defaults(run=run_distill)
    for kind, cls in sorted({**HEADS, "draft": DraftHead}.items()):
        k = kinds.add_parser(kind, help=f"train a '{kind}' drafter for a target model")
        add_model_flags(k)
        _data_flags(k)
        _fast_answers_flag(k)
        _train_flags(k)
        add_head_flags(k, k.add_argument_group(f"{kind} options"), cls.Config)
        if kind == "draft":
            k.add_argument("--standalone", action="store_true", help="save the draft with its embedding and "
                           "tokenizer (a self-contained folder, ~55 MB more for smollm2-135m) instead of naming "
                           "the target to take them from")
        k.set_defaults(run=run_train, head_class=cls, standalone=False)
    r = kinds.add_parser("rest", help="build the datastore of --method rest from the target's answers and texts")
    add_model_flags(r)
    _data_flags(r, prompts_required=False)
    r.add_argument("--held-out", type=int, default=8, help="prompts left out of the datastore to measure tau on")
    r.add_argument("--eval-tokens", type=int, default=64, help="new tokens per held-out prompt for tau")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--more-data", action="append", default=[], metavar="DIR",
                   help="another distillation folder of this model's answers (answers.jsonl, e.g. from `spekit "
                        "train distill` over other prompts) whose answers join the datastore as they are; "
                        "repeatable")
    r.add_argument("--texts", action="append", default=[], metavar="FILE",
                   help="texts the model wrote before (a server's logs: texts separated by blank lines, or JSONL "
                        "records with text / response / completion / output, or the assistant turns of messages / "
                        "conversations), joining the datastore as they are; repeatable. With --texts or "
                        "--more-data, --prompts is optional (without it no tau is measured)")
    r.set_defaults(run=run_rest)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_head_flags(parser: argparse.ArgumentParser, group, config_cls) -> None:
    """One flag per field of the head's Config that has a default (fields without one come from the target):
    `--field-name`, or `--head-field-name` where a training flag already has that name. Values default to None
    (the head's own default)."""
    taken = {opt for a in parser._actions for opt in a.option_strings}
    for f in dataclasses.fields(config_cls):
        if f.default is dataclasses.MISSING:
            continue
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:
            flag = "--head-" + f.name.replace("_", "-")
        kind = type(f.default)
        if kind is tuple:
            group.add_argument(flag, dest=HEAD_DEST + f.name, type=int, nargs="*", default=None,
                               help=f"(default: {f.default})")
        else:
            group.add_argument(flag, dest=HEAD_DEST + f.name, type=_bool if kind is bool else kind, default=None,
                               help=f"(default: {f.default})")


def _fast_answers_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fast-answers", action="store_true",
                   help="answer with the model's own kernels instead of the row-invariant forms spekit verifies "
                        "with in bfloat16 / float16 / int8 / int4 on a CPU (1.3-1.6x faster there; an answer "
                        "may part from the exact greedy one after some tokens, which training does not mind; "
                        "without it a data set rebuilds token for token)")


def _data_flags(p: argparse.ArgumentParser, prompts_required: bool = True) -> None:
    p.add_argument("--prompts", required=prompts_required, help="text (one prompt a line) or JSONL (turns / "
                   "conversations / prompt records); never the Spec-Bench questions")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--data", default=None, help="distillation folder (answers.jsonl, features/); default: "
                   "OUT.work/data (train) or OUT (distill)")
    p.add_argument("--keep-answers", action="store_true",
                   help="train on the answers a conversation file holds (ShareGPT / OpenAI messages: the assistant "
                        "turns) instead of letting the target write its own: no generation, and the heads still "
                        "learn the target's distributions along them (EAGLE's recipe); unanswered turns and those "
                        "after them are answered by the target")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length when distilling (default 256)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts answered together (default 32)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")


def _train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimiser step (default 4096)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine decay")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    g.add_argument("--checkpoint-every", type=int, default=200)
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    g.add_argument("--init", default=None, metavar="DIR",
                   help="start from trained heads of this kind (e.g. the shipped ones) instead of fresh weights: "
                   "re-align heads after the target was fine-tuned, or train them on more data; the heads' own "
                   "config and draft vocabulary are kept (for kind draft: a folder `spekit train draft` wrote)")
    g.add_argument("--held-out", type=int, default=8, help="prompts kept out of training to measure tau on")
    g.add_argument("--eval-tokens", type=int, default=64, help="new tokens per held-out prompt for tau")
    g.add_argument("--max-len", type=int, default=1024, help="tokens per training sequence; longer prompts are cut "
                   "from the left (default 1024)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="type the trained weights are stored in (default bfloat16: half the size, what engines "
                   "load; the checkpoint for --resume stays float32)")
    g.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                   help="autocast the head's training forward (accelerate's mixed precision; the weights stay "
                   "float32); pays where bfloat16 is native: a CUDA GPU, a CPU with AVX512-BF16 or AMX (default: no)")


def run_prompts(args: argparse.Namespace) -> None:
    from ..train.prompts import write_prompts
    if args.count < 1:
        raise UserError("--count must be >= 1")
    from ..bench.answers import check_writable
    out = Path(args.out)
    check_writable(out, "--out")                      # a folder, or a place no file can be made: before the work
    if args.self_instruct and (args.passages or args.catalogs or args.categories):
        raise UserError("--passages, --catalogs and --categories shape the built prompts; --self-instruct lets "
                        "the model write them: give one or the other")
    if args.self_instruct:
        from ..api import Spekit
        from ..train.self_prompts import write_self_prompts
        sk = Spekit.load(args.model, "plain", None, args.dtype, args.device, args.quantize, args.compile)
        write_self_prompts(sk, out, args.count, args.seed)
    else:
        material = {"catalogs": args.catalogs,
                    "categories": [c for c in (args.categories or "").split(",") if c] or None}
        if args.passages:
            from ..train.texts import read_texts
            material["documents"] = read_texts(args.passages)
        write_prompts(out, args.count, args.seed, **material)
    written = len(out.read_text(encoding="utf-8").splitlines())
    short = f" (only {written} distinct ones could be built from this material)" if written < args.count else ""
    print(f"[spekit] wrote {written} prompts to {out}{short}", file=sys.stderr)


def run_distill(args: argparse.Namespace) -> None:
    from ..api import Spekit
    if args.data is None:
        args.data = args.out
    check_data_flags(args, None)
    training_records(args)                           # bad input fails before the model loads
    sk = Spekit.load(args.model, "plain", None, args.dtype, args.device, args.quantize, args.compile,
                     exact=not args.fast_answers)
    data = distill_data(args, sk)
    print(f"[spekit] answers in {data / 'answers.jsonl'}", file=sys.stderr)


def run_train(args: argparse.Namespace) -> None:
    from ..train.run import train_command
    train_command(args, command_line())


def run_rest(args: argparse.Namespace) -> None:
    from ..train.rest import rest_command
    rest_command(args, command_line())


def command_line() -> str:
    return "spekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
