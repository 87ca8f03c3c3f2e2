"""The `spekit` command. Flags mirror the frozen configs one to one; text lives here, tokens in the core."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings

from . import __version__
from .allocator import freeze_after_loading, keep_freed_memory
from .config import SamplingConfig, UserError, text_or_file
from .proposers import REGISTRY


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, defaults: bool = True) -> None:
    """One flag per field: `max_new_tokens` -> `--max-new-tokens`. With defaults=False every flag defaults to
    None (meaning: the config's own default), so only what the user typed is passed on."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if any(flag in a.option_strings for a in parser._actions):
            continue
        default = f.default if defaults else None
        kind = type(f.default)
        if "parse" in f.metadata:           # a tuple of parsed entries, e.g. --logit-bias 50256:-100 13:2.5
            parser.add_argument(flag, nargs="*",
                                default=list(default) if defaults else None, metavar=f.metadata["metavar"],
                                help="(default: none)")
        elif kind is bool:
            parser.add_argument(flag, action="store_true", default=default, help="(default: off)")
        elif kind is tuple:
            parser.add_argument(flag, type=int, nargs="*", default=list(default) if defaults else None,
                                metavar="ID", help=f"(default: none)")
        else:
            parser.add_argument(flag, type=kind, default=default,
                                help=f.metadata.get("help", f"(default: {f.default})"))


def sampling_from(args: argparse.Namespace) -> SamplingConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingConfig)}
    for f in dataclasses.fields(SamplingConfig):
        if type(f.default) is tuple:
            parse = f.metadata.get("parse", lambda x: x)      # the field's own parser, raising UserError
            values[f.name] = tuple(parse(x) for x in values[f.name] or ())
    values["json_schema"] = text_or_file(values.get("json_schema") or "", "--json-schema")
    return SamplingConfig(**values)


def method_args(args: argparse.Namespace) -> dict:
    names = {f.name for cls in REGISTRY.values() for f in dataclasses.fields(cls.Options)}
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def stop_text(text: str) -> str:
    """--stop's type: a text stop sequence must hold something (an empty one would end every sample at once)."""
    if not text:
        raise argparse.ArgumentTypeError("a stop sequence must not be empty")
    return text


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="bundled name (smollm2-135m, gemma3-270m), HF folder, "
                   ".gguf file, hub id, or a fine-tuned adapter's folder (LoRA, ...; merged into the base it names) "
                   "(default: smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="auto: bfloat16 where this machine multiplies it natively (CUDA, a CPU with AVX-512 bf16 / "
                   "AMX), else float32, where speculation pays more (default: float32)")
    p.add_argument("--device", default="auto", help="auto: cuda where a CUDA GPU is present, else cpu; or cpu, "
                   "cuda, cuda:N (default: auto)")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the linear layers (CPU; activations, attention and the KV "
                   "cache keep --dtype). int4 groups of 32 = the layout of the bundled Q4_1 file (default: none)")
    p.add_argument("--compile", action="store_true", help="torch.compile the target's forward (a one-time "
                   "compile of 1.5-4 min on a 2-core CPU, cached on disk; pays off in long runs and servers)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="on CUDA, run every step "
                   "through the ordinary forward instead of replaying CUDA graphs of steps up to 64 tokens a row")
    p.add_argument("--cost-profile", default="auto", metavar="auto|none|flat|FILE", help="where the measured cost "
                   "of a forward over n tokens is kept between runs, so that a new process drafts without timing "
                   "forwards first: auto = the spekit cache ($SPEKIT_CACHE/costs), none = measure afresh and "
                   "keep nothing, flat = price every forward as a one-token one and never hold drafts back "
                   "(drafters draft their widest: their acceptance on full trees, not this machine's speed), or a "
                   "JSON file (default: auto)")


def add_backend_flags(p: argparse.ArgumentParser) -> None:
    """--backend and the llama.cpp backend's settings (backends.llama_cpp.LlamaSettings, field by field)."""
    from .backends.llama_cpp import LlamaSettings
    p.add_argument("--backend", default="torch", choices=["torch", "llama.cpp", "auto"],
                   help="who computes the target's logits: torch (Hugging Face forwards; the reference), llama.cpp "
                   "(a GGUF file as it ships, quantized: needs scripts/install.sh --llamacpp), or auto (llama.cpp for "
                   "a GGUF file where it is installed and runs the method) (default: torch)")
    group = p.add_argument_group("llama.cpp backend")
    group.add_argument("--ctx-size", type=int, default=LlamaSettings.ctx_size,
                       help=f"cache cells per row (default: {LlamaSettings.ctx_size})")
    group.add_argument("--parallel", type=int, default=LlamaSettings.parallel,
                       help="rows at once; raised to the command's batch (default: 1)")
    group.add_argument("--threads", type=int, default=LlamaSettings.threads,
                       help="CPU threads; 0: every core this process may use (default: 0)")
    group.add_argument("--kernels", default=LlamaSettings.kernels, choices=["exact", "fast"],
                       help="exact: kernels and cache layout under which a verification forward gives each token "
                       "the logits a one-token step would (greedy output = plain's, token for token; one draft "
                       "chain per row); fast: llama.cpp's defaults and whole draft trees in one decode, lossless up "
                       "to rounding (default: exact)")


def llama_settings(args: argparse.Namespace, rows: int = 1):
    """The llama.cpp settings the flags give, with room for `rows` rows at once."""
    from .backends.llama_cpp import LlamaSettings
    return LlamaSettings(ctx_size=args.ctx_size, parallel=max(args.parallel, rows), threads=args.threads,
                         kernels=args.kernels)


def load_spekit(args: argparse.Namespace, method: str, draft: str | None = None, rows: int = 1, **options):
    """The Spekit the model, backend and method flags describe (every command that decodes loads through this)."""
    from .api import Spekit
    return Spekit.load(args.model, method, draft, args.dtype, args.device, args.quantize, args.compile,
                       backend=args.backend, llama=llama_settings(args, rows), cuda_graphs=args.cuda_graphs,
                       cost_profile=args.cost_profile, **options)


def announce_auto(sk, args: argparse.Namespace) -> None:
    """--method auto: say which method it became, and why; args.method is that method from here on."""
    if sk.auto_reason:
        print(f"[spekit] --method auto: {sk.method} ({sk.auto_reason})", file=sys.stderr)
    args.method = sk.method


def add_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", metavar="JINJA|@FILE", help="a chat template to use instead of the model's "
                   "own (a model without one, or a template that renders tools): Jinja text, or @FILE")


def use_chat_template(sk, args: argparse.Namespace) -> None:
    """--chat-template: the tokenizer takes it, once it renders a conversation (else a one-line error)."""
    given = getattr(args, "chat_template", None)
    if not given:
        return
    text = text_or_file(given, "--chat-template")
    try:
        sk.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=text, tokenize=False,
                                         add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 (jinja's syntax and render errors)
        raise UserError(f"--chat-template does not render a conversation: {type(err).__name__}: {err}") from None
    sk.tokenizer.chat_template = text


def add_method_flags(p: argparse.ArgumentParser) -> None:
    methods = ", ".join(f"{n} ({c.help})" for n, c in sorted(REGISTRY.items()))
    p.add_argument("--method", default="plain", help=f"one of: {methods}; or auto (the method the selection "
                   "table picks from the drafters this model has here; `spekit advise` measures instead)")
    p.add_argument("--draft", default=None, help="draft model for --method draft (name or path)")
    group = p.add_argument_group("method options (default: each method's own, shown per method)")
    takers: dict[str, list] = {}
    for name, cls in sorted(REGISTRY.items()):
        for f in dataclasses.fields(cls.Options):
            takers.setdefault(f.name, []).append((name, f))
    for field_name, uses in takers.items():
        kind = type(uses[0][1].default)
        defaults = "; ".join(f"{method}: {f.default}" for method, f in uses)
        group.add_argument("--" + field_name.replace("_", "-"), type=kind, default=None, help=defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spekit", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"spekit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
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
    # each application adds its own subcommand, with set_defaults(run=its_function)
    from .bench.command import add_bench_parser
    add_bench_parser(sub)
    from .proposers.medusa import add_medusa_parser
    add_medusa_parser(sub)
    from .skipsearch import add_layer_skip_parser
    add_layer_skip_parser(sub)
    from .advise import add_advise_parser
    add_advise_parser(sub)
    from .engine_config import add_engine_config_parser
    add_engine_config_parser(sub)
    from .server.cli import add_serve_parser
    add_serve_parser(sub)
    from .train.cli import add_train_parser
    add_train_parser(sub)
    from .export import add_export_parser
    add_export_parser(sub)
    from .check import add_check_parser
    add_check_parser(sub)
    from .chat import add_chat_parser
    add_chat_parser(sub)
    from .adapters import add_merge_parser
    add_merge_parser(sub)
    return parser


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts typed, then those of --prompts-file."""
    prompts = list(args.prompts)
    if args.prompts_file:
        from .advise import read_prompts
        prompts += read_prompts(args.prompts_file, limit=None)
    if not prompts:
        raise UserError("give a PROMPT or --prompts-file FILE")
    if any(not p.strip() for p in prompts):
        raise UserError("a prompt is empty")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    return prompts


def run_generate(args: argparse.Namespace) -> None:
    from .api import Spekit
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


SHOW_DRAFTS = "\x1b[32m{}\x1b[0m"     # --show-drafts: text from accepted drafts in green (ANSI), the rest as it is


def add_show_drafts_flag(p: argparse.ArgumentParser, json_records: bool = False) -> None:
    more = "; with --json each record gets 'drafted', one 0/1 per token" if json_records else ""
    p.add_argument("--show-drafts", action="store_true", help="colour the text that came from accepted drafts "
                   f"(green, ANSI; the rest came from the target's own steps){more}")


def paint(pieces: list[tuple[str, bool]]) -> str:
    """(text, drafted) pieces as one string, the drafted ones coloured (SHOW_DRAFTS)."""
    return "".join(SHOW_DRAFTS.format(text) if drafted else text for text, drafted in pieces)


def _flags(g) -> list[bool]:
    from .text import drafted_flags
    return drafted_flags(g.result.stats.accept_lengths, len(g.result.token_ids))


def _shown(g, args: argparse.Namespace) -> str:
    """A generation's text as printed: coloured by --show-drafts."""
    if not args.show_drafts:
        return g.text
    from .text import marked_text
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


def _quiet_libraries() -> None:
    """Loading bars and advice from transformers are noise on a command line that streams text. Said through the
    environment where transformers is not imported yet (commands that load no model never import it)."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def chosen_device(device: str) -> str:
    """--device as the run uses it ("auto" resolved: said on stderr when it picks the GPU), checked."""
    from .models import check_device, resolve_device
    resolved = resolve_device(device)
    check_device(resolved)
    if device == "auto" and resolved != "cpu":
        print(f"[spekit] a CUDA GPU is present: running on {resolved} (--device cpu keeps to the CPU)",
              file=sys.stderr)
    return resolved


def main(argv: list[str] | None = None) -> int:
    from .plugins import load_plugins
    warnings.formatwarning = lambda message, *_args, **_kw: f"spekit: warning: {message}\n"   # one line, no source
    try:
        load_plugins()                  # before the parser: the add-ons' methods and their options are flags
    except UserError as err:
        print(f"spekit: error: {err}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # the command as typed (recorded by reports)
    if getattr(args, "device", None) is not None:
        try:
            args.device = chosen_device(args.device)
        except UserError as err:
            print(f"spekit: error: {err}", file=sys.stderr)
            return 2
    if getattr(args, "dtype", None) == "auto":      # what it means here, so that reports record the real one
        from .models import auto_dtype
        args.dtype = auto_dtype(getattr(args, "device", "cpu"))
        print(f"[spekit] --dtype auto: {args.dtype} on this machine", file=sys.stderr)
    _quiet_libraries()
    keep_freed_memory()            # large prefill temporaries reuse the heap instead of faulting in fresh pages
    if argv is None:               # the process's own command line: loaded models are left out of full collections
        freeze_after_loading()
    try:
        return args.run(args) or 0
    except UserError as err:
        print(f"spekit: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
