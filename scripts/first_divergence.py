"""Where a method's answers first leave `plain`'s, and how close the target's top two tokens were there.

    python scripts/first_divergence.py ANSWERS_DIR METHOD [--model smollm2-135m] [--quantize none|int8|int4]

ANSWERS_DIR is a `spekit bench --answers` folder holding plain.jsonl and METHOD.jsonl (same settings). For each
question whose answers differ: the turn and token index, both tokens, and the margin between the target's top
two logits after a fresh prefill of plain's text up to there (a margin at the logits' rounding step means a tie).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spekit.api import Spekit
from spekit.bench.questions import encode_turn, load_questions
from spekit.config import UserError


def read(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.inference_mode()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("answers")
    p.add_argument("method")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"])
    args = p.parse_args(argv)
    try:
        plain, other = read(Path(args.answers), "plain"), read(Path(args.answers), args.method)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sk = Spekit.load(args.model, "plain", quantize=args.quantize)
    questions = {q["question_id"]: q for q in load_questions(None)}
    for mine, theirs in zip(plain, other):
        history = []
        for turn, (a, b) in enumerate(zip(mine["spekit"]["token_ids"], theirs["spekit"]["token_ids"])):
            history.append({"role": "user", "content": questions[mine["question_id"]]["turns"][turn]})
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if at is not None:
                kv = sk.target.new_state(1)
                logits, _ = sk.target.prefill(kv, [encode_turn(sk.tokenizer, history, True) + a[:at]])
                top = logits[0].float().topk(2)
                print(f"{mine['question_id']} turn {turn} token {at}: plain {a[at]}, {args.method} {b[at]}; "
                      f"top two {top.indices.tolist()}, margin {float(top.values[0] - top.values[1]):.4f}")
                break
            history.append({"role": "assistant", "content": sk.decode(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
