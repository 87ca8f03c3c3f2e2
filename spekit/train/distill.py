"""Self-distillation: the target answers the training prompts (chat template, greedy, batched through spekit's
engine), and the answers are cached on disk so that every head kind trains on the same data.

The cache is one append-only JSONL file, `answers.jsonl`, one line per answered turn:
    {"id": "p00042", "prompt_ids": [...], "answer_ids": [...], "finish": "stop" | "length" | "data"}
prompt_ids is the whole chat-formatted context (the template's generation prompt included), answer_ids the
target's greedy continuation, its stop token included when it stopped. A record with two user turns gives two
lines: "<id>" and then "<id>/t2", whose context holds the first turn, the target's first answer and the second
turn. Each batch is appended with one write and fsync; a torn last line (a crash mid-write) is cut off on restart,
and ids already present are skipped, so an interrupted run resumes where it stopped.

With keep_answers, a turn the prompt file answers itself (a ShareGPT / OpenAI conversation's assistant message)
takes that answer, ended as the chat template ends it ("finish": "data"), as EAGLE trained on ShareGPT's answers:
no generation, and the heads still learn the target's own distributions, which the features give at every
position. The turns after one the data leaves unanswered are the target's.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ..config import SamplingConfig, UserError, read_user_text

ANSWERS = "answers.jsonl"


def read_answers(path: str | Path) -> list[dict]:
    """The complete records of an answers.jsonl file (a torn last line is ignored)."""
    path = Path(path)
    if path.is_dir():
        path = path / ANSWERS
    if not path.is_file():
        raise UserError(f"no distillation data at {path}; run `spekit train distill` first")
    out = []
    for line in read_user_text(path, "answers file").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "answer_ids" in rec:
            out.append(rec)
    return out


def _repair(path: Path) -> None:
    """Cut a torn last line (no final newline) so that appends start on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def _append(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


class Distiller:
    """Answers prompts with the target (greedy) and appends them to `out/answers.jsonl`."""

    def __init__(self, sk, out: str | Path, max_new_tokens: int = 256, batch_size: int = 32,
                 max_prompt_tokens: int = 1024, keep_answers: bool = False):
        self.sk, self.out, self.keep_answers = sk, Path(out), keep_answers
        self.cfg = SamplingConfig(max_new_tokens=max_new_tokens)
        self.batch_size, self.max_prompt_tokens = batch_size, max_prompt_tokens
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out} is a file, not a folder")
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / ANSWERS
        _repair(self.path)

    def _chat_ids(self, turns: list[str], answers: list[str], prompt: bool) -> list[int]:
        """The chat template over user turns and the answers given so far (one fewer, or as many); prompt: end
        with the template's generation prompt."""
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                messages.append({"role": "assistant", "content": answers[i]})
        tok = self.sk.tokenizer
        return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt),
                   add_special_tokens=False).input_ids

    def _context(self, turns: list[str], answers: list[list[int]]) -> list[int]:
        if not self.sk.has_chat_template:
            return self.sk.encode("\n\n".join(turns), chat=False)
        return self._chat_ids(turns, [self.sk.decode(a) for a in answers], prompt=True)

    def _data_answer(self, turns: list[str], answers: list[list[int]], answer: str, context: list[int]) -> list[int]:
        """The data's answer to the last turn as tokens, ended as the chat template ends an assistant message (up
        to and with its first stop token), or with the first stop token where the template's text does not
        continue the context."""
        stops = self.sk.engine.stop_ids
        ids = None
        if self.sk.has_chat_template:
            full = self._chat_ids(turns, [self.sk.decode(a) for a in answers] + [answer], prompt=False)
            if full[: len(context)] == context:
                ids = full[len(context):]
                end = next((i for i, t in enumerate(ids) if t in stops), None)
                ids = ids if end is None else ids[: end + 1]
        if ids is None:
            ids = self.sk.encode(answer, chat=False) + list(stops[:1])
        return ids

    def run(self, records: list[dict], progress: bool = True) -> int:
        """Answer every turn not yet in the cache; returns how many answers were added."""
        done = {r["id"]: r for r in read_answers(self.path)} if self.path.is_file() else {}
        added = 0
        for turn in range(max(len(r["turns"]) for r in records)):
            todo, given = [], []
            for r in records:
                rid = r["id"] if turn == 0 else f"{r['id']}/t{turn + 1}"
                previous = [r["id"] if t == 0 else f"{r['id']}/t{t + 1}" for t in range(turn)]
                if turn >= len(r["turns"]) or rid in done or any(p not in done for p in previous):
                    continue
                earlier = [done[p]["answer_ids"] for p in previous]
                ids = self._context(r["turns"][: turn + 1], earlier)
                if len(ids) > self.max_prompt_tokens:
                    continue
                answer = self._given(r, turn, [done[p] for p in previous])
                if answer is None:
                    todo.append((rid, ids))
                else:
                    given.append({"id": rid, "prompt_ids": ids, "finish": "data",
                                  "answer_ids": self._data_answer(r["turns"][: turn + 1], earlier, answer, ids)})
            if given:
                _append(self.path, given)
                done.update((rec["id"], rec) for rec in given)
            added += len(given) + self._answer(todo, done, progress, f"distill turn {turn + 1}")
        return added

    def _given(self, record: dict, turn: int, previous: list[dict]) -> str | None:
        """The data's answer to this turn, when answers are kept and every earlier turn's was the data's too."""
        answers = record.get("answers") or []
        if not self.keep_answers or turn >= len(answers) or any(p.get("finish") != "data" for p in previous):
            return None
        return answers[turn]

    def _answer(self, todo: list[tuple[str, list[int]]], done: dict, progress: bool, desc: str) -> int:
        # in file order, a few batches at a time sorted by length (less padding): a run cut short leaves a
        # representative part of the prompts done, not only the shortest
        group = self.batch_size * 8
        todo = [x for i in range(0, len(todo), group) for x in sorted(todo[i: i + group], key=lambda x: len(x[1]))]
        bar = tqdm(total=len(todo), desc=desc, unit="prompt", file=sys.stderr, disable=not progress)
        tokens, t0 = 0, time.perf_counter()
        for batch in _chunks(todo, self.batch_size):
            results = self.sk.engine.generate([ids for _, ids in batch], self.cfg)
            recs = [{"id": rid, "prompt_ids": ids, "answer_ids": res.token_ids, "finish": res.finish_reason}
                    for (rid, ids), res in zip(batch, results)]
            _append(self.path, recs)
            for rec in recs:
                done[rec["id"]] = rec
            tokens += sum(len(r["answer_ids"]) for r in recs)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        bar.close()
        return len(todo)
