"""How well trained heads agree with their target where it matters: teacher-forced top-1 agreement with the target's
token at each unrolled draft step, on the target's own greedy answers to the first N Spec-Bench questions of every
category (an evaluation set: answers and features are cached under --work, never used for training). Overall, per
category, and split between the answers that ran to --max-new-tokens and those that ended. A benchmark program, not
a test:

    python scripts/agreement.py spekit/data/heads/smollm2-135m/eagle3 [more head folders] [--per-category 5]

`--head-context N` lets the head see only the latest N prompt tokens before the answer, as the methods' catch-up
does (`--head-context`, default 128); by default it sees the whole prompt, as in training.

`--exit-layers 12,15,24` measures the same for early exit's draft: the first E layers, the final norm and the LM
head, against the whole model (what `--method early-exit --exit-layer E` can hope to have accepted).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from spekit import Spekit
from spekit.bench.questions import load_questions
from spekit.heads.base import FeatureBatch, load_head
from spekit.train.distill import Distiller, read_answers
from spekit.train.features import FeatureStore



def records(path: str | None, per_category: int) -> list[dict]:
    """The first turns of the first `per_category` questions of each of the thirteen categories."""
    taken: dict[str, int] = defaultdict(int)
    out = []
    for q in load_questions(path):
        cat = q["raw_category"]
        if taken[cat] < per_category:
            taken[cat] += 1
            out.append({"id": f"{cat}-{q['question_id']}", "turns": q["turns"][:1]})
    return out


def latest(batch: FeatureBatch, prompt_len: int, context: int) -> FeatureBatch:
    """The batch from `context` tokens before the answer on (a head's rotary attention sees only offsets, so the
    shorter view is what a catch-up that dropped the earlier entries gives)."""
    start = max(0, prompt_len - context) if context else 0
    return FeatureBatch(batch.tokens[:, start:], batch.loss_mask[:, start:],
                        {k: v[:, start:] for k, v in batch.hidden.items()})


@torch.no_grad()
def agreement(head, sk, store: FeatureStore, names: list[str], context: int = 0) -> dict[str, float]:
    """The head's top-1 figures over these sequences (its training figures, measured without training)."""
    sums: dict[str, float] = defaultdict(float)
    for name in names:
        batch = latest(store.batch([name], head.training_layers(), "cpu"), store.sequences[store.position[name]][2],
                       context)
        _, figures = head.training_loss(batch, sk.target)
        weight = store.length(name)
        for k, v in figures.items():
            if k.startswith(("top1", "acc")):           # eagle / eagle3 / medusa: top1*, mtp: acc<k>
                sums[k] += v * weight
        sums["_tokens"] += weight
    total = sums.pop("_tokens")
    return {k: round(v / total, 3) for k, v in sorted(sums.items())}


@torch.no_grad()
def exit_agreement(sk, store: FeatureStore, names: list[str], layer: int) -> float:
    """Top-1 agreement of lm_head(norm(hidden[layer])) with the target's token, token-weighted over these sequences."""
    last = sk.target.num_layers
    model = sk.target.model
    norm, lm_head = model.get_decoder().norm, model.get_output_embeddings()
    hits = total = 0
    for name in names:
        batch = store.batch([name], [layer, last], "cpu")
        mask = batch.loss_mask[0]
        want = lm_head(batch.hidden[last][0][mask]).argmax(-1)
        got = lm_head(norm(batch.hidden[layer][0][mask])).argmax(-1)
        hits, total = hits + int((got == want).sum()), total + len(want)
    return round(hits / max(total, 1), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("heads", nargs="*", help="head folders (their kind is read from their config)")
    p.add_argument("--exit-layers", default="", help="comma-separated exit layers E to measure early exit's draft at")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--head-context", type=int, default=0, help="prompt tokens the head sees (0 = all)")
    p.add_argument("--work", default="runs/agreement", help="cache of the target's answers and features")
    args = p.parse_args()
    torch.set_num_threads(2)
    sk = Spekit.load(args.model, "plain")
    recs = records(args.questions, args.per_category)
    Distiller(sk, args.work, args.max_new_tokens, batch_size=16).run(recs)
    answers = [a for a in read_answers(args.work) if a["id"] in {r["id"] for r in recs}]
    store = FeatureStore(args.work, answers, sk.target, max_len=args.max_new_tokens + 1024)
    at_limit = {a["id"] for a in answers if len(a["answer_ids"]) >= args.max_new_tokens}
    by_cat: dict[str, list[str]] = defaultdict(list)
    for name, _, _ in store.sequences:
        by_cat[name.rsplit("-", 1)[0]].append(name)
    for folder in args.heads:
        head = load_head(folder, sk.target).float().eval()
        store.ensure(head.training_layers())
        ctx = args.head_context
        row = {"heads": folder, "overall": agreement(head, sk, store, [n for ns in by_cat.values() for n in ns], ctx)}
        first = next(iter(row["overall"]))
        row["by_category"] = {c: agreement(head, sk, store, ns, ctx)[first] for c, ns in sorted(by_cat.items())}
        names = [n for ns in by_cat.values() for n in ns]
        if 0 < len(at_limit & set(names)) < len(names):     # answers cut at the limit (where a small model loops)
            row["at_the_limit"] = agreement(head, sk, store, [n for n in names if n in at_limit], ctx)
            row["ended"] = agreement(head, sk, store, [n for n in names if n not in at_limit], ctx)
        print(json.dumps(row))
    for layer in [int(x) for x in args.exit_layers.split(",") if x]:
        store.ensure([layer, sk.target.num_layers])
        names = [n for ns in by_cat.values() for n in ns]
        row = {"exit_layer": layer, "overall": exit_agreement(sk, store, names, layer),
               "by_category": {c: exit_agreement(sk, store, ns, layer) for c, ns in sorted(by_cat.items())}}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
