"""`spekit chat`: a conversation on the command line with any method, the answers streamed, each followed by its
figures (tokens, tok/s, τ) on stderr. Lines are read from stdin (a terminal or a pipe); `/reset` starts again,
`/exit` (or end of input) leaves. The conversation goes through the model's chat template each turn, the whole
history with it, so a turn's greedy answer is the one `generate` gives for the same messages."""
from __future__ import annotations

import argparse
import sys

from ..config import UserError

HELP = "/reset: start a new conversation, /exit: leave"


def add_chat_parser(sub) -> None:
    from .flags import (add_backend_flags, add_dataclass_flags, add_method_flags, add_model_flags,
                        add_show_drafts_flag, add_template_flag, stop_text)
    from ..config import SamplingConfig
    p = sub.add_parser("chat", help="talk to a model on the command line, with speculative decoding")
    add_model_flags(p)
    add_backend_flags(p)
    add_method_flags(p)
    add_dataclass_flags(p.add_argument_group("sampling"), SamplingConfig)
    p.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    add_template_flag(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", type=stop_text,
                   help="a text stop sequence (repeatable)")
    add_show_drafts_flag(p)
    p.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> None:
    from .flags import announce_auto, load_spekit, method_args, sampling_from, use_chat_template
    sampling = sampling_from(args)
    if sampling.n != 1 or sampling.wants_logprobs:
        raise UserError("chat writes one answer a turn: --n 1, no --logprobs")
    sk = load_spekit(args, args.method, args.draft, **method_args(args))
    announce_auto(sk, args)
    use_chat_template(sk, args)
    if not sk.has_chat_template:
        raise UserError(f"{args.model} has no chat template: give one (--chat-template), or use spekit generate "
                        "--raw")
    sk.engine.check_settings(sampling)    # a bad --regex, --json-schema or stop id: once, not at every turn
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    tty = sys.stdin.isatty()
    if tty:
        print(f"[spekit] {args.model}, method {args.method}. {HELP}", file=sys.stderr)
    while True:
        line = _read(tty)
        if line is None or line.strip() == "/exit":
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(opening)
            print("[spekit] a new conversation", file=sys.stderr)
            continue
        turn = messages + [{"role": "user", "content": text}]
        try:
            answer = _answer(sk, turn, sampling, args)
        except UserError as err:        # a conversation past the context, say: the session goes on
            print(f"spekit: error: {err}. {HELP}", file=sys.stderr)
            continue
        messages = turn + [{"role": "assistant", "content": answer}]


def _read(tty: bool) -> str | None:
    try:
        return input("> ") if tty else (sys.stdin.readline() or None)
    except EOFError:
        return None


def _answer(sk, messages: list[dict], sampling, args: argparse.Namespace) -> str:
    """Stream one answer to stdout and its figures to stderr; returns its text."""
    from .flags import paint
    pieces = []
    for piece, drafted in sk.stream_marked(messages, sampling, stop=args.stop):
        pieces.append(piece)
        sys.stdout.write(paint([(piece, drafted)]) if args.show_drafts else piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = sk.last_result.stats
    lossy = "" if stats.lossless else " [LOSSY acceptance]"
    print(f"[spekit] {stats.new_tokens} tokens, {stats.new_tokens / max(stats.wall_s, 1e-9):.1f} tok/s, "
          f"tau {stats.new_tokens / max(stats.target_forwards, 1):.2f}{lossy}", file=sys.stderr)
    return "".join(pieces)
