"""Answer files in Spec-Bench's schema, one `<method>.jsonl` per contestant in an answers folder, so that
Spec-Bench's own evaluation/speed.py reads them (choices[0].new_tokens / wall_time / accept_lengths). spekit's
extra figures sit under the key "spekit". A run that stops resumes: questions already answered are skipped, and a
folder recorded with other settings is refused rather than mixed."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from ..config import UserError, can_write_in, write_atomic
from .contestants import Outcome

META = "run.json"


def check_writable(path: str | Path, what: str, folder: bool = False) -> None:
    """Refuse, before a long run, a place its output could not go: `path` (a file, or a folder with `folder`) must
    not exist as the other kind, and the nearest existing folder above it (or it) must be writable."""
    path = Path(path)
    kind = "folder" if folder else "file"
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise UserError(f"{what} {path} is a {'file' if folder else 'folder'}; give a {kind}")
    up = path.absolute() if folder else path.absolute().parent
    while not os.path.exists(up):
        up = up.parent
    if not os.path.isdir(up):
        raise UserError(f"{what} {path} cannot be made: {up} is a file, not a folder")
    if not can_write_in(up):
        raise UserError(f"{what} {path} cannot be written: no write permission in {up}")


def claim(folder: Path, settings: dict) -> None:
    """Make `folder` the answers folder of a run with these settings (refuse one recorded with others)."""
    meta = folder / META
    if meta.is_file():
        before = json.loads(meta.read_text())
        if before != settings:
            diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
            raise UserError(f"{folder} holds answers recorded with other settings ({', '.join(diff)}); "
                            "use another answers folder or delete it")
        return
    write_atomic(meta, json.dumps(settings, indent=1) + "\n")


def read(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_ids(folder: Path, name: str) -> set:
    return {r["question_id"] for r in read(folder, name)}


def record(question: dict, model_id: str, name: str, texts: list[str], outs: list[Outcome]) -> dict:
    """One question's answer (all its turns) in Spec-Bench's answer schema."""
    width = max((len(o.offered) for o in outs), default=0)
    offered = [sum(o.offered[d] for o in outs if d < len(o.offered)) for d in range(width)]
    accepted = [sum(o.accepted[d] for o in outs if d < len(o.accepted)) for d in range(width)]
    return {
        "question_id": question["question_id"], "answer_id": uuid.uuid4().hex, "model_id": f"{model_id}-{name}",
        "category": question["raw_category"], "tstamp": time.time(),
        "choices": [{"index": 0, "turns": texts,
                     "decoding_steps": [o.forwards or 0 for o in outs],
                     "new_tokens": [len(o.token_ids) for o in outs],
                     "wall_time": [round(o.wall_s, 5) for o in outs],
                     "accept_lengths": [n for o in outs for n in o.accept_lengths]}],
        "spekit": {"method": name, "group": question["category"], "token_ids": [o.token_ids for o in outs],
                   "charged_s": [round(o.charged_s, 5) for o in outs],
                   "forwards": [o.forwards for o in outs],
                   "draft_s": [o.draft_s for o in outs], "verify_s": [o.verify_s for o in outs],
                   "recording_s": [o.recording_s for o in outs],
                   "offered": offered, "accepted": accepted},
    }


def append(folder: Path, name: str, records: list[dict]) -> None:
    path = folder / f"{name}.jsonl"
    old = path.read_text() if path.is_file() else ""
    write_atomic(path, old + "".join(json.dumps(r) + "\n" for r in records))
