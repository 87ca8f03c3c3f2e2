"""The training-free search for layer skipping (as SWIFT, Xia et al. 2024, does it: optimise the skipped set for the
draft's agreement with the full model on the user's own text), the skip file, and `spekit layer-skip search`.

The full model writes greedy continuations of the user's prompts; every prompt + continuation is prefilled once.
A candidate set of kept layers is then scored *exactly* as the `layer-skip` proposer would draft on that text, in
one forward: a node group per start position t holds the next `depth` tokens of the text; each node sees the full
model's cache before t and the nodes of its group before it, so its draft prediction is the one the proposer would
make after a run of accepted tokens. The score is the tokens per unit of cost that the acceptance profile promises
(verification priced by the target's prior in `costs.py`, its precision on this CPU; each draft forward by the kept
weights' share).

Search: rank layers by what skipping each alone costs in agreement, skip them in that order while the score
improves, then try swapping a skipped layer for a kept one (random pairs, seeded) and keep what helps.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .bench.answers import check_writable
from .config import SamplingConfig, UserError, write_atomic
from .costs import PRIOR, prior_cost

if TYPE_CHECKING:      # not at run time: `spekit --help` builds this command's flags without transformers
    from .cache import KVState
    from .layers import Stack
    from .target import Target

FORMAT = "spekit-layer-skip/1"


def fingerprint(target: Target) -> dict:
    """What identifies a model in a skip file: its type and shape, and a sample of its input embedding. The
    embedding stays put under a change of dtype (bfloat16 rounds it by a part in 512) and under weight-only
    quantization (which packs the linear layers only), so a file searched in float32 serves the same model loaded
    in bfloat16 or int4 (an exact hash of the weights refused it there, or failed on the packed layers)."""
    flat = target.model.get_input_embeddings().weight.detach().flatten()
    at = torch.arange(SAMPLE, device=flat.device) * (flat.numel() // SAMPLE)       # [SAMPLE] spread evenly
    return {"type": target.config.model_type, "layers": target.num_layers, "vocab": target.vocab_size,
            "embedding_sample": flat[at].float().cpu().tolist()}


def same_model(recorded, target: Target) -> bool:
    """Whether a skip file's `model` entry describes this target (the sample within SAME_WITHIN, relative)."""
    mine = fingerprint(target)
    if not isinstance(recorded, dict) or any(recorded.get(k) != mine[k] for k in ("type", "layers", "vocab")):
        return False
    try:
        theirs = torch.tensor(recorded.get("embedding_sample"), dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return False
    ours = torch.tensor(mine["embedding_sample"])
    return theirs.shape == ours.shape and bool((theirs - ours).norm() <= SAME_WITHIN * ours.norm())


SAMPLE, SAME_WITHIN = 256, 0.01    # another model's embedding is ~1.4 off (relative); bfloat16's rounding ~0.002


def save(path: str, target: Target, skipped: list[int], report: dict) -> None:
    """Write the skip file atomically (temporary name, then rename)."""
    data = {"format": FORMAT, "model": fingerprint(target), "num_layers": target.num_layers,
            "skip": sorted(skipped), **report}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def load(path: str, target: Target) -> tuple[list[int], float | None]:
    """The skipped layers of a skip file made for this model, and the first draft token's acceptance the search
    measured (None when the file does not say)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no skip file at {path} (make one with: spekit layer-skip search)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the skip file {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("skip"), list):
        raise UserError(f"{path} is not a spekit layer-skip file")
    if isinstance(data.get("model"), str):           # an exact hash of the weights, before 2026-12-04
        raise UserError(f"the skip file {path} names its model as an older spekit did; run spekit layer-skip "
                        "search again")
    if not same_model(data.get("model"), target) or data.get("num_layers") != target.num_layers:
        raise UserError(f"the skip file {path} was made for another model; run spekit layer-skip search for this "
                        "one")
    skip = data["skip"]
    if not all(isinstance(i, int) and 0 <= i < target.num_layers for i in skip) or len(set(skip)) >= target.num_layers:
        raise UserError(f"the skip file {path} names layers this model does not have, or all of them")
    profile = data.get("acceptance_profile") or [None]
    first = profile[0] if isinstance(profile[0], (int, float)) and 0 <= profile[0] <= 1 else None
    return sorted(set(skip)), first


@dataclass
class Evaluator:
    """Scores kept-layer sets on texts (prompt + the full model's greedy continuation)."""
    stack: Stack
    kv: KVState                # the full model's cache of every text
    tokens: torch.Tensor       # [B, N] node tokens
    positions: torch.Tensor    # [B, N]
    allowed: torch.Tensor      # [B, N, S+N]
    targets: torch.Tensor      # [B, G, D] the full model's next token after each node, -1 for padding groups
    depth: int

    @classmethod
    @torch.inference_mode()
    def build(cls, target: Target, texts: list[list[int]], starts: list[int], depth: int, per_text: int):
        from .layers import Stack
        kv = target.new_state(len(texts))
        target.prefill(kv, texts)
        groups = [list(range(s, len(t) - depth))[:: max(1, (len(t) - depth - s) // per_text)][:per_text]
                  for t, s in zip(texts, starts)]
        g = max(len(x) for x in groups)
        if g == 0:
            raise UserError("the texts are too short to search on")
        batch, n = len(texts), g * depth
        tokens = torch.zeros(batch, n, dtype=torch.long)
        positions = torch.full((batch, n), -1, dtype=torch.long)
        targets = torch.full((batch, g, depth), -1, dtype=torch.long)
        for b, (text, starts_b) in enumerate(zip(texts, groups)):
            for i, t in enumerate(starts_b):
                tokens[b, i * depth:(i + 1) * depth] = torch.tensor(text[t:t + depth])
                positions[b, i * depth:(i + 1) * depth] = torch.arange(t, t + depth)
                targets[b, i] = torch.tensor(text[t + 1:t + depth + 1])
        device = target.device
        tokens, positions, targets = tokens.to(device), positions.to(device), targets.to(device)
        start = positions.view(batch, g, depth)[:, :, :1].expand(-1, -1, depth).reshape(batch, n)   # [B, N]
        old = (kv.slot_pos[:, None, :] >= 0) & (kv.slot_pos[:, None, :] < start[:, :, None])
        node = torch.arange(n, device=device)
        same = (node[:, None] // depth == node[None, :] // depth) & (node[None, :] <= node[:, None])
        new = same[None] & (positions >= 0)[:, None, :] | torch.eye(n, dtype=torch.bool, device=device)[None]
        return cls(Stack(target), kv, tokens, positions, torch.cat([old, new], dim=2), targets, depth)

    @torch.inference_mode()
    def profile(self, kept: list[int]) -> list[float]:
        """P(the first j draft tokens are all accepted), j = 1..depth."""
        from .layers import Scratch
        scratch = Scratch(self.stack, self.kv, kept)
        try:
            logits = scratch.step(self.tokens, self.positions, self.allowed[..., -self.tokens.shape[1]:],
                                  self.allowed)
        finally:
            scratch.close()
        batch, g, d = self.targets.shape
        hit = (logits.argmax(-1).view(batch, g, d) == self.targets).long().cumprod(-1)   # [B, G, D]
        real = self.targets[..., 0] >= 0
        return (hit[real].float().mean(0)).tolist()

    def score(self, kept: list[int]) -> float:
        """Tokens per unit of cost at the best draft length (1.0 = plain decoding), with the verification costs of
        the target's prior (its precision on this CPU, as drafts are sized under sampling)."""
        return rate(self.profile(kept), self.stack.relative_cost(kept), self.stack.target.costs.prior)


def rate(profile: list[float], step_cost: float, table: dict[int, float] = PRIOR) -> float:
    """Tokens per unit of cost at the best draft length, 1.0 (plain decoding) when no length pays: a draft of k
    tokens costs k draft forwards of `step_cost` each and a verification over k + 1 tokens (the prior `table`)."""
    best, gain = 1.0, 1.0
    for k, p in enumerate(profile, start=1):
        gain += p
        best = max(best, gain / (prior_cost(k + 1, table=table) + k * step_cost))
    return best


def search(ev: Evaluator, trials: int = 40, seed: int = 0, log=None) -> tuple[list[int], float]:
    """The skipped layers with the best score, and that score."""
    n = ev.stack.num_layers
    everything = list(range(n))
    alone = {i: ev.profile([j for j in everything if j != i])[0] for i in everything}
    order = sorted(everything, key=lambda i: -alone[i])              # least harmful to skip first
    best_skip, best = [], 1.0
    for size in range(1, n):
        kept = sorted(set(everything) - set(order[:size]))
        profile, cost = ev.profile(kept), ev.stack.relative_cost(kept)
        score = rate(profile, cost, ev.stack.target.costs.prior)
        if log:
            log(f"skip {size:2d} layers: first draft token accepted {profile[0]:.2f}, a draft token costs "
                f"{cost:.2f} of a forward: score {score:.3f}")
        if score > best:
            best_skip, best = order[:size], score
        elif best_skip and size > len(best_skip) + 3:    # no early stop before anything pays: small skips never do
            break
    rng = random.Random(seed)
    for _ in range(trials if best_skip else 0):
        out, back = rng.choice(best_skip), rng.choice([i for i in everything if i not in best_skip])
        cand = [i for i in best_skip if i != out] + [back]
        score = ev.score(sorted(set(everything) - set(cand)))
        if score > best:
            best_skip, best = cand, score
            if log:
                log(f"swap {out} -> {back}: score {score:.3f}")
    return sorted(best_skip), best


def add_layer_skip_parser(sub) -> None:
    from .cli import add_model_flags
    p = sub.add_parser("layer-skip", help="find the layers to skip for --method layer-skip")
    actions = p.add_subparsers(dest="action", required=True)
    s = actions.add_parser("search", help="search the skipped set on your prompts and write a skip file")
    add_model_flags(s)
    s.add_argument("--prompts", required=True, help="text file, one prompt per line, or .jsonl (turns/prompt/text); "
                   "use your own, typical ones")
    s.add_argument("--out", required=True, help="skip file to write (JSON)")
    s.add_argument("--max-new-tokens", type=int, default=64, help="continuation the full model writes per prompt")
    s.add_argument("--depth", type=int, default=4, help="draft tokens scored per start position (default: 4)")
    s.add_argument("--per-prompt", type=int, default=16, help="start positions scored per prompt (default: 16)")
    s.add_argument("--trials", type=int, default=40, help="swap trials after the greedy pass (default: 40)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--raw", action="store_true", help="feed prompts as they are (default: the chat template "
                   "when the model has one)")
    s.set_defaults(run=run_search)


def run_search(args: argparse.Namespace) -> None:
    from .advise import read_prompts
    from .api import Spekit
    from .layers import Stack
    prompts = read_prompts(args.prompts, limit=None)
    if not 1 <= args.depth <= 16 or args.per_prompt < 1 or args.max_new_tokens <= args.depth:
        raise UserError("need 1 <= depth <= 16 < max_new_tokens and per_prompt >= 1")
    if args.trials < 0:
        raise UserError(f"--trials must be >= 0, got {args.trials}")
    check_writable(args.out, "--out")                        # before the search, not after its minutes
    sk = Spekit.load(args.model, "plain", None, args.dtype, args.device, args.quantize, args.compile,
                     cuda_graphs=args.cuda_graphs, cost_profile=args.cost_profile)
    Stack(sk.target)                                          # unsupported architectures fail before the work
    ids = [sk.encode(p, False if args.raw else None) for p in prompts]
    results = sk.engine.generate(ids, SamplingConfig(max_new_tokens=args.max_new_tokens))
    texts = [r.prompt_ids + r.token_ids for r in results]
    ev = Evaluator.build(sk.target, texts, [len(r.prompt_ids) - 1 for r in results], args.depth, args.per_prompt)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)   # noqa: E731
    skipped, score = search(ev, args.trials, args.seed, log)
    kept = [i for i in range(sk.target.num_layers) if i not in skipped]
    profile = ev.profile(kept) if skipped else []
    save(args.out, sk.target, skipped, {"score": round(score, 4), "acceptance_profile": [round(p, 4) for p in profile],
                                        "prompts": len(prompts), "depth": args.depth})
    if not skipped:
        print(f"no set of skipped layers pays on these prompts (each draft token costs too much for how often it is "
              f"accepted; see the lines above): the file keeps every layer, and --method layer-skip with it runs "
              f"plain steps; wrote {args.out}")
        return
    print(f"skip {len(skipped)} of {sk.target.num_layers} layers: {skipped}; expected speed {score:.2f}x of plain "
          f"(prior costs); P(first j drafts accepted) = {[round(p, 2) for p in profile]}; wrote {args.out}")
