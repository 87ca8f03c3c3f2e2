"""Spec-Bench questions: reading, category grouping, prompt selection."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import UserError

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def spec_bench_category(category: str) -> str:
    """Spec-Bench reports the eight MT-bench categories together as mt_bench."""
    return "mt_bench" if category in MT_BENCH else category


def default_questions() -> Path | None:
    for path in (Path.cwd().parent / "shared/data/spec_bench/question.jsonl", DEFAULT_QUESTIONS):
        if path.is_file():
            return path
    return None


def load_questions(path: str | Path | None) -> list[dict]:
    """Records with question_id, category (Spec-Bench group) and turns."""
    path = Path(path) if path else default_questions()
    if path is None:
        raise UserError("no question file: pass --questions PATH (Spec-Bench question.jsonl)")
    if not path.is_file():
        raise UserError(f"question file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = rec["turns"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserError(f"{path}:{n}: not a Spec-Bench question record ({err})") from None
        out.append({"question_id": rec.get("question_id", n), "turns": turns,
                    "category": spec_bench_category(rec.get("category", "unknown"))})
    if not out:
        raise UserError(f"{path} holds no questions")
    return out


def pick(questions: list[dict], per_category: int, categories: list[str] | None) -> list[dict]:
    """The first `per_category` questions of each category, in Spec-Bench's category order."""
    wanted = categories or [c for c in CATEGORIES if any(q["category"] == c for q in questions)]
    unknown = sorted(set(wanted) - {q["category"] for q in questions})
    if unknown:
        raise UserError(f"no questions in categories {unknown}")
    return [q for c in wanted for q in [q for q in questions if q["category"] == c][:per_category]]
