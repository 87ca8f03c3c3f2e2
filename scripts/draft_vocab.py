"""Give a trained head (eagle, mtp) a draft vocabulary after its training, without training again: the `--size`
most frequent answer tokens of the distillation folders it was trained on, as `spekit train ... --draft-vocab N`
chooses it before training (training fits the whole distribution either way, so no weight changes). Writes the
head folder anew (a temporary folder, then a rename), its meta recording the command.

    python scripts/draft_vocab.py spekit/data/heads/smollm2-135m/eagle --size 8192 \
        --data data/distill/smollm2-135m-s8 data/distill/smollm2-135m-s9
"""
from __future__ import annotations

import argparse
import sys

import torch

from spekit.config import UserError
from spekit.heads.base import load_head, read_config, save_head
from spekit.backends.torch_models import load_model
from spekit.backends.torch_target import Target
from spekit.train.distill import read_answers


def answer_counts(folders: list[str], vocab: int) -> torch.Tensor:
    """[V] how often each token is an answer token in these distillation folders."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for folder in folders:
        for rec in read_answers(folder):
            counts += torch.bincount(torch.tensor(rec["answer_ids"], dtype=torch.long), minlength=vocab).double()
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("head")
    p.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    p.add_argument("--data", nargs="+", required=True, help="distillation folders (answers.jsonl) it learnt from")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default=None, help="output folder (default: the head folder, replaced)")
    args = p.parse_args(argv)
    try:
        model = load_model(args.model, "bfloat16")
        target = Target(model.model)
        kind = read_config(args.head)["kind"]
        head = load_head(args.head, target, kind).reconfigured(draft_vocab=args.size)
        counts = answer_counts(args.data, target.vocab_size)
        head.choose_vocab(counts)
        covered = float(counts[head.token_map.cpu()].sum() / counts.sum())
        meta = {**head.meta, "draft_vocab": {"size": args.size, "answer_tokens_covered": round(covered, 4),
                                             "command": "python scripts/draft_vocab.py " + " ".join(sys.argv[1:])}}
        save_head(head, args.out or args.head, meta, dtype=torch.bfloat16)
    except UserError as err:
        print(f"draft_vocab: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out or args.head}: draft vocabulary of {args.size} tokens, {covered:.1%} of the answer tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
