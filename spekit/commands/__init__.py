"""The `spekit` command: each subcommand is a module of this package that adds its parser and runs it. The library
(everything outside this package) never imports it."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from .. import __version__
from ..backends.host_memory import freeze_after_loading, keep_freed_memory
from ..config import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spekit", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"spekit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from .generate import add_generate_parser
    add_generate_parser(sub)
    # each application adds its own subcommand, with set_defaults(run=its_function)
    from .bench import add_bench_parser
    add_bench_parser(sub)
    from .medusa import add_medusa_parser
    add_medusa_parser(sub)
    from .layer_skip import add_layer_skip_parser
    add_layer_skip_parser(sub)
    from .advise import add_advise_parser
    add_advise_parser(sub)
    from .engine_config import add_engine_config_parser
    add_engine_config_parser(sub)
    from .serve import add_serve_parser
    add_serve_parser(sub)
    from .train import add_train_parser
    add_train_parser(sub)
    from .export import add_export_parser
    add_export_parser(sub)
    from .check import add_check_parser
    add_check_parser(sub)
    from .chat import add_chat_parser
    add_chat_parser(sub)
    from .merge import add_merge_parser
    add_merge_parser(sub)
    return parser


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
    from ..backends.torch_models import check_device, resolve_device
    resolved = resolve_device(device)
    check_device(resolved)
    if device == "auto" and resolved != "cpu":
        print(f"[spekit] a CUDA GPU is present: running on {resolved} (--device cpu keeps to the CPU)",
              file=sys.stderr)
    return resolved


def main(argv: list[str] | None = None) -> int:
    from ..proposers.plugins import load_plugins
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
        from ..backends.torch_models import auto_dtype
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
