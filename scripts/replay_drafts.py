"""Replay a drafter on recorded greedy answers, without the target: the tokens a step it would gain (tau) and what
that is worth per unit of verification cost, overall and per Spec-Bench category. The drafter sees the text as
decoding would (the prompt, then the answer as steps commit it), sizes each draft with a Budget priced by a cost
curve, and keeps the longest prefix of its chain that the recorded answer agrees with, plus the target's next token
(under greedy the answer is the target's own choice at every position). What drafting costs the host is not counted.

    spekit bench [--backend llama.cpp] [--raw] --limit 3 --max-new-tokens 256 --methods plain --answers DIR
    python scripts/replay_drafts.py --answers DIR [--method ngram] [--costs 1:1,2:1.97,4:2.96,8:4.87,16:8.64,32:17]

--costs: a forward over n tokens against one (`scripts/llama_cost.py` measures them on llama.cpp; linear between
the given widths); default: spekit's prior for PyTorch. Only drafters that need nothing of the target replay here.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from spekit.api import Spekit
from spekit.bench.questions import encode_turn, load_questions
from spekit.config import SamplingConfig, UserError
from spekit.pacing import Budget
from spekit.pacing.priors import prior_cost
from spekit.proposers import REGISTRY
from spekit.proposers.base import StepContext


def curve(text: str | None):
    """n -> relative cost of a forward over n tokens, from "n:cost,..." (linear between, proportional past the last)."""
    if not text:
        return prior_cost
    try:
        table = sorted((int(n), float(c)) for n, c in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise UserError(f"--costs wants n:cost pairs separated by commas, got {text!r}") from None

    def cost(n: int) -> float:
        for (a, ca), (b, cb) in zip(table, table[1:]):
            if a <= n <= b:
                return ca + (cb - ca) * (n - a) / (b - a)
        return table[-1][1] * n / table[-1][0] if n > table[-1][0] else table[0][1]
    return cost


def turns(folder: Path, questions: str | None):
    """(category, prompt ids, answer ids) of every recorded turn of plain's answers, prompts rebuilt as the bench
    built them (the conversation so far, the assistant's earlier turns as recorded)."""
    settings = json.loads((folder / "run.json").read_text())
    answers = folder / "plain.jsonl"
    if not answers.is_file():
        raise UserError(f"{answers} not found: record plain's answers with spekit bench --methods plain --answers DIR")
    base = Spekit.load(settings["model"], backend=settings.get("backend", "torch"))
    asked = {q["question_id"]: q for q in load_questions(questions)}
    out = []
    for line in answers.read_text().splitlines():
        rec = json.loads(line)
        history = []
        for text, user, ids in zip(rec["choices"][0]["turns"], asked[rec["question_id"]]["turns"],
                                   rec["spekit"]["token_ids"]):
            history.append({"role": "user", "content": user})
            out.append((rec["spekit"]["group"], encode_turn(base.tokenizer, history, settings["chat"]), ids))
            history.append({"role": "assistant", "content": text})
    return out


def replay(method: str, prompt: list[int], answer: list[int], cost) -> tuple[int, int, float]:
    """(tokens, steps, cost in one-token steps) of one answer under `method`'s drafts."""
    cls = REGISTRY[method]
    if cls.needs_draft_model or cls.needs_hidden_states or getattr(cls, "needs_logits", False):
        raise UserError(f"method '{method}' reads its target or a draft model: it cannot be replayed without them")
    proposer = cls(None, cls.Options())
    cfg = SamplingConfig(max_new_tokens=len(answer))
    text, done, steps, spent = list(prompt) + answer[:1], 1, 0, 0.0

    def context() -> StepContext:
        pending = torch.tensor([text[-1]])
        budget = Budget(room=[len(answer) - done], cost=cost)
        return StepContext([text], pending, torch.tensor([len(text) - 1]), cfg, None, None, budget)
    proposer.begin(context())
    while done < len(answer):
        ctx = context()
        tree = proposer.propose(ctx)
        draft = [] if tree is None else tree.tokens[0, 1:][tree.valid[0, 1:]].tolist()
        kept = 0
        while kept < len(draft) and done + kept < len(answer) and draft[kept] == answer[done + kept]:
            kept += 1
        gained = answer[done: done + kept + 1]
        spent += cost(len(draft) + 1)
        steps += 1
        proposer.observe(ctx, None, [gained])
        text += gained
        done += len(gained)
    return len(answer) - 1, steps, spent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--answers", required=True, help="a bench answers folder holding plain.jsonl and run.json")
    p.add_argument("--questions", default=None, help="the question file the bench used (default: Spec-Bench's)")
    p.add_argument("--method", default="ngram")
    p.add_argument("--costs", default=None, help="n:cost,... a forward over n tokens against one (default: prior)")
    args = p.parse_args(argv)
    try:
        if args.method not in REGISTRY:
            raise UserError(f"unknown method {args.method!r}")
        cost = curve(args.costs)
        sums = defaultdict(lambda: [0, 0, 0.0])
        for category, prompt, answer in turns(Path(args.answers), args.questions):
            if len(answer) < 2:
                continue
            got = replay(args.method, prompt, answer, cost)
            for key in (category, "overall"):
                sums[key] = [x + y for x, y in zip(sums[key], got)]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, (tokens, steps, spent) in sums.items():
        print(f"{key:16s} tau {tokens / steps:.2f}  tokens per unit of cost {tokens / spent:.3f}  ({tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
