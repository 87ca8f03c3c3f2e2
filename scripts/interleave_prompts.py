"""Two or more prompt files (JSONL records with "id" and "turns") as one, taken in turn so that a distillation cut
short still holds every kind; each file's ids get a prefix, and a record whose first turn already stands in an
earlier set's prompt file (--seen) is left out, so merged sets do not train twice on one request.

    python scripts/interleave_prompts.py self.jsonl=s31-:5 tmpl.jsonl=t32-:2 --seen data/distill/*/prompts.jsonl \
        --out prompts.jsonl

FILE=PREFIX:N takes N records of FILE a round (default 1). Written through a temporary file, then renamed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spekit.config import UserError, read_user_text, write_atomic
from spekit.train.prompt_files import jsonl_records


def parse_source(spec: str) -> tuple[Path, str, int]:
    """FILE[=PREFIX[:N]] -> (path, prefix, records a round)."""
    path, _, rest = spec.partition("=")
    prefix, _, count = rest.partition(":")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise UserError(f"{spec}: N in FILE=PREFIX:N must be a whole number") from None
    if n < 1:
        raise UserError(f"{spec}: N in FILE=PREFIX:N must be at least 1")
    return Path(path), prefix, n


def read_records(path: Path) -> list[dict]:
    """The file's records whole (their "category" and "source" kept), through the prompt files' own reader of
    JSONL lines (its errors, and its refusal of the Spec-Bench question set)."""
    lines = [(n, line) for n, line in enumerate(read_user_text(path, "prompt file").splitlines(), 1) if line.strip()]
    out = []
    for n, rec in jsonl_records(path, lines):
        if not (isinstance(rec, dict) and "id" in rec and isinstance(rec.get("turns"), list) and rec["turns"]
                and isinstance(rec["turns"][0], str)):
            raise UserError(f"{path}:{n}: a record needs an \"id\" and a non-empty \"turns\" list of texts")
        out.append(rec)
    return out


def first_turns(paths: list[Path]) -> set[str]:
    return {rec["turns"][0].strip() for p in paths for rec in read_records(p)}


def interleave(sources: list[tuple[list[dict], str, int]], seen: set[str]) -> tuple[list[dict], int]:
    """Round-robin over the sources, N records of each a round; returns (records, how many were left out)."""
    cursors = [0] * len(sources)
    out, dropped = [], 0
    while any(c < len(recs) for c, (recs, _, _) in zip(cursors, sources)):
        for k, (recs, prefix, n) in enumerate(sources):
            for rec in recs[cursors[k]:cursors[k] + n]:
                first = rec["turns"][0].strip()
                if first in seen:
                    dropped += 1
                    continue
                seen.add(first)
                out.append({**rec, "id": f"{prefix}{rec['id']}"})
            cursors[k] += n
    return out, dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", metavar="FILE=PREFIX:N")
    p.add_argument("--seen", nargs="*", default=[], help="earlier sets' prompt files whose requests to leave out")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    try:
        sources = [(read_records(path), prefix, n) for path, prefix, n in map(parse_source, args.sources)]
        records, dropped = interleave(sources, first_turns([Path(s) for s in args.seen]))
    except UserError as e:
        sys.exit(f"interleave_prompts: {e}")
    write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} records -> {args.out} ({dropped} left out: their first turn is in an earlier set or file)")


if __name__ == "__main__":
    main()
