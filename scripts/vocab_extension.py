"""Could EAGLE-3 heads draft tokens outside their draft vocabulary by scoring them with the target's own LM-head
rows? Teacher-forced top-1 agreement with the target's (unrestricted) token at each unrolled step, on the cached
Spec-Bench answers of scripts/agreement.py (run it first), three ways: the draft vocabulary alone; it plus the
prompt's tokens outside it; it plus every other token. A benchmark program, not a test:

    python scripts/agreement.py spekit/data/heads/smollm2-135m/eagle3     # answers and features in runs/agreement
    python scripts/vocab_extension.py spekit/data/heads/smollm2-135m/eagle3

Measured 2026-12-05 on the shipped heads (overall, step 1): 0.381, 0.331, 0.044: the rows the head was never trained
against win the argmax, so a wider vocabulary needs training.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from spekit import Spekit
from spekit.heads.base import load_head
from spekit.train.distill import read_answers
from spekit.train.features import FeatureStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("heads", help="an eagle3 head folder")
    p.add_argument("--work", default="runs/agreement", help="scripts/agreement.py's cache")
    p.add_argument("--max-new-tokens", type=int, default=128, help="as given to scripts/agreement.py")
    args = p.parse_args()
    torch.set_num_threads(2)
    sk = Spekit.load("smollm2-135m", "plain")
    store = FeatureStore(args.work, read_answers(args.work), sk.target, max_len=args.max_new_tokens + 1024)
    head = load_head(args.heads, sk.target).float().eval()
    store.ensure(head.training_layers())
    rows = sk.target.model.get_output_embeddings().weight.float()          # [V, H]
    ids, last_layer = head.draft_ids, int(head.target_config["num_layers"])
    hits: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    with torch.no_grad():
        for name, _, _ in store.sequences:
            batch = store.batch([name], head.training_layers(), "cpu")
            last = batch.hidden[last_layer].float()
            want_all = (last @ rows.T).argmax(-1)                           # [1, L] the target's own tokens
            prompt = batch.tokens[0][~batch.loss_mask[0]].unique()
            extra = prompt[~head.t2d[prompt]]                               # the prompt's tokens outside the vocab
            for j, out, valid in head.unroll(batch, sk.target, 3):
                want = want_all[:, (torch.arange(out.shape[1]) + 1 + j).clamp(max=last.shape[1] - 1)]
                normed = head.norm(out).float()
                drafted = head.lm_head(normed)                              # [1, M, Vd]
                everything = normed @ rows.T
                everything[..., ids] = drafted
                ways = {"vocab": ids[drafted.argmax(-1)],
                        "vocab+prompt": torch.cat([ids, extra])[torch.cat([drafted, normed @ rows[extra].T], -1)
                                                                .argmax(-1)],
                        "all": everything.argmax(-1)}
                for way, pred in ways.items():
                    for key in (name.rsplit("-", 1)[0], "overall"):
                        hits[key][f"{way}@{j + 1}"][0] += int(((pred == want) & valid).sum())
                        hits[key][f"{way}@{j + 1}"][1] += int(valid.sum())
    for key, figures in sorted(hits.items()):
        print(json.dumps({"category": key, **{k: round(h / max(1, n), 3) for k, (h, n) in figures.items()}}))


if __name__ == "__main__":
    main()
