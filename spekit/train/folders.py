"""Where training keeps its data and checkpoint, and the checks of those flags that need no model (bad input fails
before the work)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import UserError


HEAD_DEST = "head__"


def check_data_flags(args: argparse.Namespace, kind: str | None) -> None:
    """The checks of the data and output flags that need no model, so that bad input fails before the work: the
    numbers in range, --out (a folder replaced by what `kind` writes; kind None: answers added to it) and --data
    writable folders, --data not inside --out."""
    from ..heads.base import check_out
    for name, least in (("batch_size", 1), ("max_new_tokens", 1), ("limit", 1), ("eval_tokens", 1),
                        ("held_out", 0), ("max_len", 2)):
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise UserError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    check_out(args.out, kind)
    if args.data is not None:
        check_out(args.data, None, flag="--data")
        out, data = Path(args.out).resolve(), Path(args.data).resolve()
        if kind is not None and (data == out or out in data.parents):
            raise UserError(f"--data {args.data} is inside --out {args.out}, which the result replaces; give "
                            f"another folder")


def training_records(args: argparse.Namespace) -> list[dict]:
    """The first --limit records of --prompts; with --keep-answers the file must hold answers to keep."""
    from .prompt_files import read_prompts
    records = read_prompts(args.prompts)[: args.limit]
    if getattr(args, "keep_answers", False) and not any("answers" in r for r in records):
        raise UserError(f"--keep-answers: {args.prompts} holds no answers to keep (they come from ShareGPT "
                        f"'conversations' or OpenAI 'messages' records with assistant turns)")
    return records


def distill_data(args: argparse.Namespace, sk) -> Path:
    """Answer the prompts (resuming) into the data folder; returns it."""
    from ..train.distill import Distiller
    records = training_records(args)
    data = data_dir(args)
    Distiller(sk, data, args.max_new_tokens, args.batch_size, keep_answers=args.keep_answers).run(records)
    return data


def work_dir(args: argparse.Namespace) -> Path:
    """Where training keeps its checkpoint (and, by default, its data): beside the output folder."""
    out = Path(args.out)
    return out.with_name(out.name + ".work")


def data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data) if args.data else work_dir(args) / "data"
