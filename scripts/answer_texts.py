"""The target's own earlier answers (the answers.jsonl of `spekit train distill` folders) as a texts file: JSONL
records {"text": ...}, for `spekit train prompts --passages FILE` (prose in the target's own style to summarise and
answer from) or `spekit train rest --texts FILE`.

    python scripts/answer_texts.py data/distill/smollm2-135m-s8 data/distill/smollm2-135m-s9 --out texts.jsonl

Kept: answers of at least --min-words words that do not loop (at least --min-distinct of their 4-word runs differ:
a small model cut at its token limit often repeats one sentence).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spekit.config import UserError


def distinct_share(words: list[str], n: int = 4) -> float:
    """The share of the n-word runs of words that occur once or first: 1.0 for text that never repeats itself."""
    runs = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(runs)) / max(1, len(runs))


def answer_texts(folders: list[str], tokenizer, min_words: int, min_distinct: float) -> list[str]:
    from spekit.train.distill import read_answers

    out = []
    for folder in folders:
        for rec in read_answers(folder):
            text = tokenizer.decode(rec["answer_ids"], skip_special_tokens=True).strip()
            words = text.split()
            if len(words) >= min_words and distinct_share(words) >= min_distinct:
                out.append(text)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="+", help="`spekit train distill` folders (or their answers.jsonl)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="the target whose tokenizer decodes the answers")
    p.add_argument("--min-words", type=int, default=80)
    p.add_argument("--min-distinct", type=float, default=0.9)
    args = p.parse_args(argv)
    try:
        from spekit.backends.torch_models import load_model
        texts = answer_texts(args.data, load_model(args.model).tokenizer, args.min_words, args.min_distinct)
        if not texts:
            raise UserError(f"no answer of {args.min_words}+ words that does not loop in {', '.join(args.data)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tmp.replace(out)
    print(f"{len(texts)} texts -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
