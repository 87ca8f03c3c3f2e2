"""Spec-Bench questions: reading, category selection, and the conversation of a question's turns as token ids."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import UserError, read_user_text

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


OWN = "prompts"      # the category of questions given as plain prompts


def load_questions(path: str | Path | None) -> list[dict]:
    """Records with question_id, category (Spec-Bench group), raw_category and turns (1 or 2 user messages).
    A line is a Spec-Bench record ({"turns": [...], "category": ...}), a JSON record with "prompt" or "text", or
    else a prompt as it is (your own prompts, one a line: category "prompts")."""
    path = Path(path) if path else default_questions()
    if path is None:
        raise UserError("no question file: pass --questions PATH (Spec-Bench question.jsonl)")
    out = []
    for n, line in enumerate(read_user_text(path, "question file").splitlines(), 1):
        if not line.strip():
            continue
        rec = {"turns": [line.strip()], "category": OWN}
        if line.lstrip().startswith("{"):
            try:
                given = json.loads(line)
                turns = given["turns"] if "turns" in given else [given.get("prompt", given.get("text"))]
                category = given.get("category", "unknown" if "turns" in given else OWN)
                rec = {**given, "turns": turns, "category": category}
                if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                    raise TypeError("turns must be a list of non-empty strings (or give prompt or text)")
            except (json.JSONDecodeError, TypeError, AttributeError) as err:
                raise UserError(f"{path}:{n}: not a question record ({err}); a line is a Spec-Bench record, "
                                "{\"prompt\": ...}, or a prompt as plain text") from None
        turns = rec["turns"]
        raw = rec.get("category", "unknown")
        out.append({"question_id": rec.get("question_id", n), "turns": turns, "raw_category": raw,
                    "category": spec_bench_category(raw)})
    if not out:
        raise UserError(f"{path} holds no questions")
    return out


def pick(questions: list[dict], per_category: int | None, categories: list[str] | None) -> list[dict]:
    """The first `per_category` (None: all) questions of each category, in Spec-Bench's category order.
    A category may be a Spec-Bench group (mt_bench, qa ...) or one MT-bench category (writing, coding ...)."""
    present = list(dict.fromkeys(q["category"] for q in questions))
    raw = {q["raw_category"] for q in questions}
    wanted = categories or [c for c in CATEGORIES if c in present] + [c for c in present if c not in CATEGORIES]
    unknown = [c for c in wanted if c not in present and c not in raw]
    if unknown:
        known = ", ".join(present + sorted(raw - set(present)))
        raise UserError(f"unknown category {', '.join(unknown)}; this question file has: {known}")
    if per_category is not None and per_category < 1:
        raise UserError(f"--limit must be >= 1, got {per_category}")
    out: list[dict] = []
    for c in wanted:
        sel = [q for q in questions if c in (q["category"], q["raw_category"]) and q not in out]
        out.extend(sel[:per_category] if per_category else sel)
    return out


def encode_turn(tokenizer, history: list[dict], chat: bool) -> list[int]:
    """Token ids of a conversation so far (user/assistant messages, the last one the user's), ready for the
    assistant's answer: through the chat template when `chat`, else the turns joined as plain text."""
    if chat:
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer("\n\n".join(m["content"] for m in history)).input_ids
