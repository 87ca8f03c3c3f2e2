"""`spekit layer-skip search`: find the layers to skip for `--method layer-skip` on the user's prompts, and write the
skip file."""
from __future__ import annotations

import argparse
import sys

from ..bench.answers import check_writable
from ..config import SamplingConfig, UserError
from ..heads.skip_set import save
from ..train.layer_skip import Evaluator, search


def add_layer_skip_parser(sub) -> None:
    from .flags import add_model_flags
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
    from .flags import read_prompts
    from ..api import Spekit
    from ..backends.decoder_layers import Stack
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
