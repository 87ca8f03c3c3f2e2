"""`spekit generate`: answers to prompts with any method, streamed, batched, or set against plain (`--compare`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..config import SamplingConfig, UserError
from .flags import (add_backend_flags, add_dataclass_flags, add_method_flags, add_model_flags, add_show_drafts_flag,
                    add_template_flag, announce_auto, load_spekit, method_args, paint, sampling_from, stop_text,
                    use_chat_template)


def add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts")
    add_model_flags(gen)
    add_backend_flags(gen)
    add_method_flags(gen)
    add_dataclass_flags(gen.add_argument_group("sampling"), SamplingConfig)
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap prompts in the model's chat template (default when it has one)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed prompts as they are")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", type=stop_text,
                     help="a text stop sequence (repeatable): a sample ends when its text holds one, and is cut "
                     "before it")
    gen.add_argument("--json", action="store_true", help="one JSON object per line per prompt and sample")
    add_template_flag(gen)
    gen.add_argument("--prompts-file", metavar="FILE", help="more prompts: one a line, or JSONL records with "
                     "turns (the first is taken), prompt or text; answered --batch-size at a time, in file order")
    gen.add_argument("--batch-size", type=int, default=1, help="prompts decoded together in one batch (default 1)")
    gen.add_argument("--compare", action="store_true", help="also answer with plain decoding (same model, same "
                     "settings) and report the speedup, and under greedy decoding whether every answer is the same")
    add_show_drafts_flag(gen, json_records=True)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.set_defaults(run=run_generate)


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts typed, then those of --prompts-file."""
    prompts = list(args.prompts)
    if args.prompts_file:
        from .flags import read_prompts
        prompts += read_prompts(args.prompts_file, limit=None)
    if not prompts:
        raise UserError("give a PROMPT or --prompts-file FILE")
    if any(not p.strip() for p in prompts):
        raise UserError("a prompt is empty")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    return prompts


def run_generate(args: argparse.Namespace) -> None:
    sampling = sampling_from(args)
    prompts = _prompts(args)
    if sampling.wants_logprobs and not args.json:
        raise UserError("--logprobs and --top-logprobs need --json: the log-probabilities are fields of its output")
    sk = load_spekit(args, args.method, args.draft, rows=args.batch_size * sampling.n, **method_args(args))
    announce_auto(sk, args)
    use_chat_template(sk, args)
    if args.compare:
        _compare(sk, args, prompts, sampling)
        return
    if len(prompts) > args.batch_size:
        _in_batches(sk, args, prompts, sampling)
        return
    if args.json:
        for g in sk.generate(prompts, sampling, chat=args.chat, stop=args.stop):
            print(json.dumps(_record(g, args)), flush=True)
        return
    if len(prompts) == 1 and sampling.n == 1:
        for piece, drafted in sk.stream_marked(prompts[0], sampling, chat=args.chat, stop=args.stop):
            sys.stdout.write(paint([(piece, drafted)]) if args.show_drafts else piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        _summary(args.method, [sk.last_result])
        return
    gens = sk.generate(prompts, sampling, chat=args.chat, stop=args.stop)
    for g in gens:
        print(f"--- prompt {g.result.prompt_index} sample {g.result.sample_index}\n{_shown(g, args)}")
    _summary(args.method, [g.result for g in gens])


def _flags(g) -> list[bool]:
    from ..detokenize import drafted_flags
    return drafted_flags(g.result.stats.accept_lengths, len(g.result.token_ids))


def _shown(g, args: argparse.Namespace) -> str:
    """A generation's text as printed: coloured by --show-drafts."""
    if not args.show_drafts:
        return g.text
    from ..detokenize import marked_text
    return paint(marked_text(g.tokenizer, g.result.token_ids, _flags(g), args.stop))


def _record(g, args: argparse.Namespace) -> dict:
    """A generation's --json record; with --show-drafts, 'drafted' per token."""
    record = g.as_dict(args.method)
    if args.show_drafts:
        record["drafted"] = [int(f) for f in _flags(g)]
    return record


def _in_batches(sk, args: argparse.Namespace, prompts: list[str], sampling: SamplingConfig) -> None:
    """A batch job: --batch-size prompts at a time, each batch's answers printed as it ends (prompt indices
    count over the whole list), one summary at the end."""
    results, wall = [], 0.0
    for start in range(0, len(prompts), args.batch_size):
        gens = sk.generate(prompts[start:start + args.batch_size], sampling, chat=args.chat, stop=args.stop)
        for g in gens:
            g.result.prompt_index += start
            if args.json:
                print(json.dumps(_record(g, args)), flush=True)
            else:
                print(f"--- prompt {g.result.prompt_index} sample {g.result.sample_index}\n{_shown(g, args)}",
                      flush=True)
        results += [g.result for g in gens]
        wall += max(g.result.stats.wall_s for g in gens)
    _summary(args.method, results, wall)


def _compare(sk, args: argparse.Namespace, prompts: list[str], sampling: SamplingConfig) -> None:
    """--compare: the prompts answered by plain decoding and by the method, both warmed up first (the first
    forwards and the cost calibration are slow), in batches of --batch-size; the method's answers are printed,
    then both summaries and the verdict."""
    if args.method == "plain":
        raise UserError("--compare sets a method against plain: give --method")
    plain = sk.with_method("plain")
    runs = {}
    for name, run in (("plain", plain), (args.method, sk)):
        run.generate(prompts[:1], dataclasses.replace(sampling, max_new_tokens=4), chat=args.chat)
        run.engine.proposer.forget()              # the warm-up's text is not drafted from when it is timed
        gens, wall = [], 0.0
        for start in range(0, len(prompts), args.batch_size):
            batch = run.generate(prompts[start:start + args.batch_size], sampling, chat=args.chat, stop=args.stop)
            wall += max(g.result.stats.wall_s for g in batch)
            gens += batch
        runs[name] = (gens, wall)
    gens, wall = runs[args.method]
    for i, g in enumerate(gens):
        if args.json:
            print(json.dumps(_record(g, args)), flush=True)
        else:
            print(f"--- prompt {i // sampling.n} sample {g.result.sample_index}\n{_shown(g, args)}")
    for name, (gens, wall) in runs.items():
        _summary(name, [g.result for g in gens], wall)
    tokens = {name: sum(g.result.stats.new_tokens for g in gens) for name, (gens, _) in runs.items()}
    rate = {name: tokens[name] / wall for name, (_, wall) in runs.items()}
    verdict = f"{args.method} is {rate[args.method] / rate['plain']:.2f}x plain"
    if sampling.greedy:
        same = sum(a.result.token_ids == b.result.token_ids for a, b in zip(runs["plain"][0], runs[args.method][0]))
        verdict += f"; {same} of {len(gens)} answers identical to plain's"
    else:
        verdict += " (sampled: the same distribution, not the same texts)"
    print(f"[spekit] {verdict}", file=sys.stderr)


def _summary(method: str, results, wall: float | None = None) -> None:
    """wall: the run's seconds (default: the longest row's, for one batch)."""
    tokens = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    wall = wall if wall is not None else max(r.stats.wall_s for r in results)
    lossy = "" if all(r.stats.lossless for r in results) else " [LOSSY acceptance: not the target's distribution]"
    print(f"[spekit] {method}: {tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tok/s, "
          f"tau {tokens / max(forwards, 1):.2f} ({forwards} target forwards){lossy}", file=sys.stderr)

