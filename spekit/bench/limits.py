"""How much of a run's speedup comes from answers cut at the token limit. A small model often loops until
`--max-new-tokens` stops it (at Spec-Bench's 1024 tokens, half of SmolLM2-135M's answered turns), and a lookup
drafter reproduces a loop whole, so the overall figure can be mostly the loops'. This splits each contestant's
figures between the turns `plain` ran to the limit and those it ended itself, and says how repetitive each kind
was: the share of tokens that continue a 4-token sequence already in the same answer."""
from __future__ import annotations

GRAM = 4


def limit_split(records: dict[str, list[dict]], limit: int) -> dict | None:
    """records: each contestant's answer records over the same questions (plain's among them). None when plain
    is absent or none of its turns reached `limit`."""
    plain = {r["question_id"]: r for r in records.get("plain", [])}
    turns = [(q, j) for q, r in plain.items() for j in range(len(r["choices"][0]["new_tokens"]))]
    at = {(q, j) for q, j in turns if plain[q]["choices"][0]["new_tokens"][j] >= limit}
    if not at:
        return None
    ended = set(turns) - at
    tokens = {k: _tokens(plain, k) for k in turns}
    speedup = {}
    for name, recs in records.items():
        mine = {r["question_id"]: r for r in recs}
        speedup[name] = {"at_limit": _ratio(mine, plain, at), "ended": _ratio(mine, plain, ended)}
    return {"limit": limit, "turns": len(turns), "at_limit": len(at),
            "token_share": round(sum(len(tokens[k]) for k in at) / max(1, sum(map(len, tokens.values()))), 3),
            "repeated": {"at_limit": _repeated([tokens[k] for k in at]),
                         "ended": _repeated([tokens[k] for k in ended])},
            "speedup": speedup}


def _tokens(recs: dict, key: tuple) -> list[int]:
    q, j = key
    return recs[q]["spekit"]["token_ids"][j]


def _rate(recs: dict, keys: set) -> float | None:
    """tok/s over these turns (None when a turn is missing or untimed)."""
    try:
        tokens = sum(recs[q]["choices"][0]["new_tokens"][j] for q, j in keys)
        seconds = sum(recs[q]["spekit"]["charged_s"][j] for q, j in keys)
    except (KeyError, IndexError):
        return None
    return tokens / seconds if seconds else None


def _ratio(mine: dict, plain: dict, keys: set) -> float | None:
    if not keys:
        return None
    a, b = _rate(mine, keys), _rate(plain, keys)
    return round(a / b, 3) if a and b else None


def _repeated(answers: list[list[int]]) -> float | None:
    """Share of tokens whose 4-gram (with the 3 tokens before it) occurred earlier in the same answer."""
    total = hits = 0
    for ids in answers:
        seen: set[tuple[int, ...]] = set()
        for i in range(GRAM - 1, len(ids)):
            g = tuple(ids[i - GRAM + 1: i + 1])
            hits += g in seen
            seen.add(g)
        total += len(ids)
    return round(hits / total, 3) if total else None


def describe(split: dict) -> str:
    """One paragraph for the bench's table."""
    rep = split["repeated"]
    head = (f"  {split['at_limit']} of {split['turns']} turns of plain ran to the {split['limit']}-token limit "
            f"({split['token_share']:.0%} of its tokens; {_pct(rep['at_limit'])} of their tokens continue a "
            f"{GRAM}-token sequence already in the answer, {_pct(rep['ended'])} in the turns that ended)")
    cells = [f"{n} {_x(s['at_limit'])} / {_x(s['ended'])}" for n, s in split["speedup"].items() if n != "plain"]
    return head + ("\n  speedup on the turns at the limit / the turns that ended: " + ", ".join(cells)
                   if cells else "")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
