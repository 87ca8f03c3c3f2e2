"""Read the user's training prompts: a text file (one prompt a line) or JSONL records, each one of
    {"turns": ["...", ...]}                                  (Spec-Bench / MT-bench style; spekit's own prompts)
    {"conversations": [{"from": "human", "value": ...}, ...]} (ShareGPT style)
    {"messages": [{"role": "user", "content": ...}, ...]}   (OpenAI chat style)
    {"prompt": "..."}
Every record becomes {"id": str, "turns": [str, ...]} (user turns). A conversation's assistant messages are kept
beside them as "answers" (the one after each user turn, None where there is none), which distillation uses only
when asked (`--keep-answers`: train on the data's answers instead of the target's own). A file that is (or
contains) the Spec-Bench question set is refused: those questions are the evaluation set."""
from __future__ import annotations

import json
from pathlib import Path

from ..bench.questions import default_questions
from ..config import UserError, read_user_text

SPEC_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag"}
_USER = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "model", "chatgpt", "bard", "bing"}
# (list key, speaker key, text key) of the conversation formats
_CONVERSATIONS = (("conversations", "from", "value"), ("messages", "role", "content"))


def _dialogue(convo, who: str, text: str, where: str) -> tuple[list, list]:
    """The user turns of a conversation and, per turn, the assistant message that answers it (None if none);
    system and other messages are left out."""
    turns, answers = [], []
    for m in convo:
        if not isinstance(m, dict):
            continue
        if m.get(who) in _USER:
            turns.append(m.get(text))
            answers.append(None)
        elif m.get(who) in _ASSISTANT and answers and answers[-1] is None:
            answers[-1] = m.get(text)
    if not all(isinstance(a, str) for a in answers if a is not None):
        raise UserError(f"{where}: assistant messages must be strings")
    return turns, answers


def _turns(rec, where: str) -> tuple[list[str], list]:
    """(user turns, their answers in the data or None each)."""
    answers = None
    if isinstance(rec, str):
        turns = [rec]
    elif not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    elif "turns" in rec:
        turns = rec["turns"]
    elif any(key in rec for key, _, _ in _CONVERSATIONS):
        key, who, text = next(c for c in _CONVERSATIONS if c[0] in rec)
        if not isinstance(rec[key], list):
            raise UserError(f"{where}: '{key}' must be a list")
        turns, answers = _dialogue(rec[key], who, text, where)
    elif "prompt" in rec:
        turns = [rec["prompt"]]
    else:
        raise UserError(f"{where}: a record needs 'turns', 'conversations', 'messages' or 'prompt' "
                        f"(keys: {sorted(rec)[:6]})")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise UserError(f"{where}: turns must be strings")
    answers = answers or [None] * len(turns)
    kept = [(t, a) for t, a in zip(turns, answers) if t.strip()]
    return [t for t, _ in kept], [a if a and a.strip() else None for _, a in kept]


def _looks_like_spec_bench(records: list) -> bool:
    tagged = [r for r in records if isinstance(r, dict) and "question_id" in r
              and r.get("category") in SPEC_BENCH_CATEGORIES]
    return len(tagged) >= max(1, len(records) // 2)


def _spec_bench_firsts() -> set[str]:
    path = default_questions()
    if path is None:
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            out.add(" ".join(json.loads(line)["turns"][0].split()))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            continue
    return out


def read_prompts(path: str | Path) -> list[dict]:
    """The prompts of a text or JSONL file as [{"id", "turns"[, "answers"]}], in file order. Raises UserError for a missing or
    empty file, a malformed record, or Spec-Bench questions."""
    path = Path(path)
    lines = [(n, line) for n, line in enumerate(read_user_text(path, "prompt file").splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"prompt file {path} is empty")
    is_jsonl = path.suffix in (".jsonl", ".json") or lines[0][1].lstrip().startswith("{")
    out = []
    if is_jsonl:
        for n, rec in jsonl_records(path, lines):
            turns, answers = _turns(rec, f"{path}:{n}")
            if turns:
                rid = rec.get("id", f"L{n}") if isinstance(rec, dict) else f"L{n}"
                out.append({"id": str(rid), "turns": turns})
                if any(a is not None for a in answers):
                    out[-1]["answers"] = answers
    else:
        out = [{"id": f"L{n}", "turns": [line]} for n, line in lines]
    if not out:
        raise UserError(f"prompt file {path} holds no prompts")
    check_not_spec_bench(path, out)
    if len({r["id"] for r in out}) != len(out):
        raise UserError(f"{path}: record ids are not unique")
    return out


def jsonl_records(path: Path, lines: list[tuple[int, str]]) -> list[tuple[int, object]]:
    """(line number, parsed record) for the numbered non-empty lines of a JSONL file. Raises UserError for a line
    that is not JSON, or records that are the Spec-Bench question set."""
    raw = []
    for n, line in lines:
        try:
            raw.append((n, json.loads(line)))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{n}: not valid JSON ({err})") from None
    if _looks_like_spec_bench([r for _, r in raw]):
        raise UserError(f"{path} is the Spec-Bench question set (question_id/category records): it is the "
                        f"evaluation set, never train on it")
    return raw


def check_not_spec_bench(path: Path, records: list[dict]) -> None:
    """Raise UserError when any record's first turn is a Spec-Bench question."""
    firsts = _spec_bench_firsts()
    hits = sum(" ".join(r["turns"][0].split()) in firsts for r in records)
    if hits:
        raise UserError(f"{path}: {hits} of its prompts are Spec-Bench questions (the evaluation set); remove "
                        f"them, never train on them")
