"""`spekit merge`: a fine-tuned adapter (LoRA, ...) merged into its base model, saved as a Hugging Face folder."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..backends.peft_adapters import CONFIG, base_of, is_adapter, merged
from ..config import UserError


def add_merge_parser(sub) -> None:
    p = sub.add_parser("merge", help="merge a fine-tuned adapter (LoRA, ...) into a base model and save the result",
                       description="Merge a PEFT adapter into a base model and save it as a Hugging Face folder.")
    p.add_argument("--model", default=None, help="the base model: bundled name, folder, .gguf or hub id (default: "
                   "the base the adapter's adapter_config.json names)")
    p.add_argument("--adapter", required=True, help="the adapter folder (adapter_config.json, adapter_model.*)")
    p.add_argument("--out", required=True, help="a new or empty folder for the merged model")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the saved weights (merged in float32 first; default bfloat16)")
    p.set_defaults(run=run_merge)


def run_merge(args: argparse.Namespace) -> None:
    from ..heads.base import staged_dir
    from ..backends.torch_models import DTYPES

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder")
    if not is_adapter(Path(args.adapter)):
        raise UserError(f"--adapter {args.adapter}: no {CONFIG} there")
    model, tokenizer = merged(args.adapter, args.model)
    model.to(DTYPES[args.dtype])
    with staged_dir(out) as tmp:                    # written aside, then renamed into place
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(f"merged {args.adapter} into {args.model or base_of(args.adapter)}: {out} ({args.dtype})")
