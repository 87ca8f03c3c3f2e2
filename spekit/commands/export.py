"""`spekit export DIR --to vllm|sglang|speculators --out OUT`: a trained head directory in the layout a serving engine
loads (speculators: the format `vllm serve DIR` runs, for EAGLE-3 and MTP)."""
from __future__ import annotations

import argparse

from ..heads.export import ENGINES, export


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write trained heads in the layout vLLM or SGLang loads")
    p.add_argument("heads", metavar="DIR", help="a spekit head directory (config.json + model.safetensors)")
    p.add_argument("--to", required=True, choices=ENGINES, help="the serving engine's layout (speculators: EAGLE-3 / MTP "
                   "in the speculators format, which `vllm serve DIR` runs)")
    p.add_argument("--out", required=True, help="output directory (new, empty, or an earlier export)")
    p.add_argument("--model", default=None, help="the target model, for heads whose export holds some of it "
                   "(Medusa heads sharing its LM head, MTP modules), and the verifier a speculators config names; default: "
                   "the --model they were trained with")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> None:
    out = export(args.heads, args.to, args.out, args.model)
    print(f"wrote {out}/config.json and {out}/model.safetensors ({args.to} layout)")
