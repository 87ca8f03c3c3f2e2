"""One training folder from several distilled ones: `spekit train ... --data` reads one folder whose answer ids match
the records of `--prompts`, and two folders may answer the same prompts (say, at 192 and at 1024 tokens). Each folder
after the first gets its ids prefixed, in its answers and in its prompt records. A preparation program, not a test:

    python scripts/merge_distilled.py --out runs/mix \
        data/distill/smollm2-135m-s8 data/distill/smollm2-135m-long=L-:data/distill/smollm2-135m-s8/prompts.jsonl:256

Each source is FOLDER[=PREFIX[:PROMPTS[:LIMIT]]]: PROMPTS defaults to FOLDER/prompts.jsonl, LIMIT to all of them.
Writes OUT/answers.jsonl and OUT/prompts.jsonl (each through a temporary file, then renamed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spekit.config import UserError, write_atomic
from spekit.train.distill import read_answers
from spekit.train.prompt_files import read_prompts


def parse_source(text: str) -> tuple[Path, str, Path, int | None]:
    folder, _, rest = text.partition("=")
    prefix, _, rest = rest.partition(":")
    prompts, _, limit = rest.partition(":")
    folder_path = Path(folder)
    return folder_path, prefix, Path(prompts) if prompts else folder_path / "prompts.jsonl", int(limit) if limit else None


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", help="FOLDER[=PREFIX[:PROMPTS[:LIMIT]]]")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    answers, prompts, seen = [], [], set()
    for source in args.sources:
        folder, prefix, prompt_file, limit = parse_source(source)
        try:
            records = [{**r, "id": prefix + r["id"]} for r in read_prompts(prompt_file)[:limit]]
            found = read_answers(folder)
        except UserError as e:
            sys.exit(f"error: {source}: {e} (a source is FOLDER[=PREFIX[:PROMPTS[:LIMIT]]])")
        clash = seen & {r["id"] for r in records}
        if clash:
            sys.exit(f"error: {source}: ids {sorted(clash)[:3]} are already taken: give it a prefix (FOLDER=PREFIX)")
        seen |= {r["id"] for r in records}
        prompts += records
        answers += [{**a, "id": prefix + a["id"]} for a in found]
    out = Path(args.out)
    write_atomic(out / "answers.jsonl", jsonl(answers))
    write_atomic(out / "prompts.jsonl", jsonl(prompts))
    print(f"{len(answers)} answers to {len(prompts)} prompts in {out}")


if __name__ == "__main__":
    main()
