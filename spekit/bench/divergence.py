"""Where a lossless method's greedy answer leaves plain's, and how close a call it was: plain's own log-probability
of its token there minus that of the method's token (the gap between their logits). Plain is run again up to that
token with log-probabilities, the way it ran in the benchmark (its own history, one-token steps), so the gap is
the one plain's own forward saw. A backend whose wide forwards round otherwise than one-token ones may leave plain
only where this gap is tiny; a large gap is a fault, not rounding."""
from __future__ import annotations

from ..config import SamplingConfig
from .questions import encode_turn

TOP = 20             # alternatives read at the divergence (a method's token outside them: the gap is at least that)


def divergences(base, questions: list[dict], records: dict[str, list[dict]], lossless: list[str], chat: bool,
                cfg: SamplingConfig) -> list[dict]:
    """One entry per (method, question, turn) whose answer leaves plain's: the token index and the gap in nats
    (None when the method's token is not among plain's TOP likeliest). Greedy runs only."""
    if not cfg.greedy or "plain" not in records:
        return []
    by_id = {q["question_id"]: q for q in questions}
    plain = {r["question_id"]: r for r in records["plain"]}
    out = []
    for name in lossless:
        for rec in records.get(name, []):
            ref = plain.get(rec["question_id"])
            if ref is None or rec["question_id"] not in by_id:
                continue
            for turn, (mine, theirs) in enumerate(zip(rec["spekit"]["token_ids"], ref["spekit"]["token_ids"])):
                at = _first_difference(mine, theirs)
                if at is None:
                    continue
                gap, again = _gap(base, by_id[rec["question_id"]], ref, turn, at,
                                  mine[at] if at < len(mine) else None, chat, cfg)
                out.append({"method": name, "question_id": rec["question_id"], "turn": turn, "token": at,
                            "gap_nats": gap, "plain_repeats": again})
                break                                  # later turns follow another history
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _gap(base, question: dict, ref: dict, turn: int, at: int, token: int | None, chat: bool,
         cfg: SamplingConfig) -> tuple[float | None, bool]:
    """(plain's log-probability of its own token at index `at` of `turn` minus that of `token`, whether plain run
    again wrote the same tokens up to there: where it does not, plain itself is not reproducible on this backend,
    its cache laid out otherwise the second time, and the gap is of another text)."""
    history = []
    for t in range(turn + 1):
        history.append({"role": "user", "content": question["turns"][t]})
        if t < turn:
            history.append({"role": "assistant", "content": ref["choices"][0]["turns"][t]})
    ids = encode_turn(base.tokenizer, history, chat)
    probe = SamplingConfig(max_new_tokens=at + 1, logprobs=True, top_logprobs=TOP, stop_ids=cfg.stop_ids)
    [result] = base.engine.generate([ids], probe)
    again = result.token_ids[:at] == ref["spekit"]["token_ids"][turn][:at]
    if len(result.logprobs) <= at or token is None:
        return None, again
    step = result.logprobs[at]
    if token == step.token:
        return 0.0, again
    theirs = next((lp for t, lp in step.top if t == token), None)
    return (None if theirs is None else round(step.logprob - theirs, 6)), again
