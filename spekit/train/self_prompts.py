"""Training prompts written by the target itself (Magpie: Xu et al. 2024): the chat template is given up to the
start of a user turn, and the model samples what a user would ask. The requests come from the model's own
instruction-tuning distribution (far more varied kinds and topics than the machine's material and spekit's templates:
advice, stories, role-play, code in many languages, health, business, school...), and no Spec-Bench text is read.

Sampled (temperature and top-p given, one seed per batch, so the same seed and count give the same file), kept when
the model ended its turn (`stop`) with at least `min_chars` characters, deduplicated, and checked against the
Spec-Bench questions like any prompt file. A record: {"id": "s00042", "category": "self", "turns": ["..."],
"source": "spekit-self-instruct"}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..config import SamplingConfig, UserError

SOURCE = "spekit-self-instruct"
MARK = "\x00spekit-user-turn\x00"


def user_turn_prefix(sk) -> list[int]:
    """Token ids of the chat template up to where a user's words begin (its default system turn included)."""
    if not sk.has_chat_template:
        raise UserError("self-instruct prompts need a model with a chat template (its user turn is sampled)")
    text = sk.tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                            add_generation_prompt=False)
    return sk.tokenizer(text[: text.index(MARK)], add_special_tokens=False).input_ids


def sample_prompts(sk, count: int, seed: int = 0, batch: int = 32, temperature: float = 1.0, top_p: float = 0.98,
                   max_tokens: int = 96, min_chars: int = 12, progress: bool = True) -> list[dict]:
    """`count` distinct user requests sampled from the model (see the module docstring)."""
    prefix, out, seen = user_turn_prefix(sk), [], set()
    bar = tqdm(total=count, desc="self-instruct", unit="prompt", file=sys.stderr, disable=not progress)
    for round_ in range(max(1, 4 * count // batch + 4)):
        if len(out) >= count:
            break
        cfg = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             seed=seed * 1_000_003 + round_, n=batch)
        for res in sk.engine.generate([prefix], cfg):
            text = sk.decode(res.token_ids).strip()
            key = " ".join(text.lower().split())
            if res.finish_reason != "stop" or len(text) < min_chars or key in seen or len(out) >= count:
                continue
            seen.add(key)
            out.append({"id": f"s{len(out):05d}", "category": "self", "turns": [text], "source": SOURCE})
            bar.update(1)
    bar.close()
    if len(out) < count:
        raise UserError(f"the model wrote only {len(out)} usable distinct requests of the {count} asked for; "
                        f"ask for fewer or raise the temperature")
    return out


def write_self_prompts(sk, path: str | Path, count: int, seed: int = 0) -> Path:
    """Sample the prompts and write them as JSONL (atomically: a temporary file, then a rename)."""
    from .prompt_files import check_not_spec_bench
    path = Path(path)
    records = sample_prompts(sk, count, seed)
    check_not_spec_bench(path, records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)
    return path
