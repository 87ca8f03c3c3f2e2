"""Flags shared by the commands: they mirror the frozen configs one to one (`--max-new-tokens` <->
`max_new_tokens`), and load what they describe."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..config import SamplingConfig, UserError, read_user_text, text_or_file
from ..proposers import REGISTRY


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
    from ..backends.llama_model import LlamaSettings
    p.add_argument("--backend", default="torch", choices=["torch", "llama.cpp", "auto"],
                   help="who computes the target's logits: torch (Hugging Face forwards; the reference), llama.cpp "
                   "(a GGUF file as it ships, quantized: needs scripts/install.sh --llamacpp), or auto (llama.cpp for "
                   "a GGUF file where it is installed and runs the method) (default: torch)")
    p.add_argument("--draft-backend", default="same", choices=["same", "torch", "llama.cpp"],
                   help="where a --draft model runs: same (the target's backend), torch or llama.cpp (a draft of "
                   "another vocabulary too) (default: same)")
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
    group.add_argument("--prefill-kernels", default=LlamaSettings.prefill, choices=["exact", "fast"],
                       help="with --kernels exact, what computes prompts of 64 tokens or more: fast (a second "
                       "context with flash attention and repacked weights, 15-30%% faster on long prompts; every "
                       "method computes its prompts so, and greedy output still equals plain's) or exact (the "
                       "exact kernels; a kept prefix then gives the very cache a fresh prompt would) (default: fast)")


def llama_settings(args: argparse.Namespace, rows: int = 1):
    """The llama.cpp settings the flags give, with room for `rows` rows at once."""
    from ..backends.llama_model import LlamaSettings
    return LlamaSettings(ctx_size=args.ctx_size, parallel=max(args.parallel, rows), threads=args.threads,
                         kernels=args.kernels, prefill=args.prefill_kernels)


def load_spekit(args: argparse.Namespace, method: str, draft: str | None = None, rows: int = 1, **options):
    """The Spekit the model, backend and method flags describe (every command that decodes loads through this)."""
    from ..api import Spekit
    return Spekit.load(args.model, method, draft, args.dtype, args.device, args.quantize, args.compile,
                       backend=args.backend, llama=llama_settings(args, rows), cuda_graphs=args.cuda_graphs,
                       cost_profile=args.cost_profile, draft_backend=args.draft_backend, **options)


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


SHOW_DRAFTS = "\x1b[32m{}\x1b[0m"     # --show-drafts: text from accepted drafts in green (ANSI), the rest as it is


def add_show_drafts_flag(p: argparse.ArgumentParser, json_records: bool = False) -> None:
    more = "; with --json each record gets 'drafted', one 0/1 per token" if json_records else ""
    p.add_argument("--show-drafts", action="store_true", help="colour the text that came from accepted drafts "
                   f"(green, ANSI; the rest came from the target's own steps){more}")


def paint(pieces: list[tuple[str, bool]]) -> str:
    """(text, drafted) pieces as one string, the drafted ones coloured (SHOW_DRAFTS)."""
    return "".join(SHOW_DRAFTS.format(text) if drafted else text for text, drafted in pieces)


def read_prompts(path: str, limit: int | None) -> list[str]:
    """The prompts of a text file (one a line) or JSONL (turns[0], prompt or text of each record); the first
    `limit` (None: all)."""
    prompts = []
    for n, line in enumerate(read_user_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        if Path(path).suffix == ".jsonl":
            try:
                rec = json.loads(line)
                line = rec["turns"][0] if "turns" in rec else rec.get("prompt") or rec["text"]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError):
                line = None
            if not isinstance(line, str):
                raise UserError(f"{path}:{n}: each line must be a JSON object with turns (a list of strings), "
                                "prompt or text")
        prompts.append(line)
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts[:limit]
