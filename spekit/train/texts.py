"""Read texts for a datastore (`spekit train rest --texts FILE`): what a model wrote before, such as a server's logs,
taken as they are. A text file holds texts separated by blank lines; a JSONL file holds records, each one of
    {"text": "..."}  (also "response", "completion" or "output")
    {"messages": [{"role": "assistant", "content": ...}, ...]}   (OpenAI style: the assistant turns)
    {"conversations": [{"from": "gpt", "value": ...}, ...]}      (ShareGPT style: the model's turns)
Prompts are not texts to draft from: user turns are left out. The Spec-Bench question set is refused (it is the
evaluation set)."""
from __future__ import annotations

from pathlib import Path

from ..config import UserError, read_user_text
from .prompt_files import jsonl_records

TEXT_KEYS = ("text", "response", "completion", "output")
_MODEL = {"assistant", "gpt", "model"}


def _record_texts(rec, where: str) -> list[str]:
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key in TEXT_KEYS:
        if key in rec:
            found = [rec[key]]
            break
    else:
        turns = rec.get("messages", rec.get("conversations"))
        if not isinstance(turns, list):
            raise UserError(f"{where}: a record needs one of {', '.join(TEXT_KEYS)}, 'messages' or "
                            f"'conversations' (keys: {sorted(rec)[:6]})")
        found = [m.get("content", m.get("value")) for m in turns
                 if isinstance(m, dict) and (m.get("role") or m.get("from")) in _MODEL]
    if not all(isinstance(t, str) for t in found):
        raise UserError(f"{where}: texts must be strings")
    return [t for t in found if t.strip()]


def read_texts(path: str | Path) -> list[str]:
    """The texts of a text or JSONL file, in file order. Raises UserError for a missing file, one without texts,
    a malformed record, or the Spec-Bench questions."""
    path = Path(path)
    content = read_user_text(path, "texts file")
    lines = [(n, line) for n, line in enumerate(content.splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"texts file {path} is empty")
    if path.suffix not in (".jsonl", ".json") and not lines[0][1].lstrip().startswith("{"):
        return [block.strip() for block in content.split("\n\n") if block.strip()]
    texts = [t for n, rec in jsonl_records(path, lines) for t in _record_texts(rec, f"{path}:{n}")]
    if not texts:
        raise UserError(f"{path} holds no model texts (user turns are left out)")
    return texts
