"""`spekit serve`: flags, binding rules, start-up."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys

from ..config import UserError

LOOPBACK = {"localhost"}


def add_serve_parser(sub) -> None:
    from .flags import add_backend_flags, add_method_flags, add_model_flags, add_template_flag
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding")
    add_model_flags(p)
    add_backend_flags(p)
    add_template_flag(p)
    add_method_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPEKIT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPEKIT_API_KEY, else none)")
    p.add_argument("--allow-no-api-key", action="store_true",
                   help="bind an address other than loopback without an API key (anyone who reaches it may use it)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together, all requests (16)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context - 1)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="largest max_tokens a request may ask (512)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (1 MiB)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run_serve)


def check_binding(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Loopback only, unless an API key is set or the user explicitly allows an open server."""
    if api_key or allow_no_key or _loopback(host):
        return
    raise UserError(f"refusing to bind {host} without an API key: pass --api-key KEY (or set SPEKIT_API_KEY), or "
                    "--allow-no-api-key to serve everyone who can reach it")


def check_address(host: str, port: int) -> None:
    """Bind host:port for a moment, as uvicorn will (SO_REUSEADDR, every address the host resolves to): a bad port,
    an unknown host or a port in use is a one-line error before the model loads, not a traceback after."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise UserError(f"cannot serve on {host}: unknown host ({err.strerror or err})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as err:
                why = " (another server is there: pick another --port)" if err.errno == errno.EADDRINUSE else ""
                raise UserError(f"cannot serve on {host}:{port}: {err.strerror or err}{why}") from None


def _loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> None:
    from .flags import announce_auto, load_spekit, method_args, use_chat_template
    check_binding(args.host, args.api_key, args.allow_no_api_key)
    for flag in ("max_batch_size", "max_new_tokens", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1")
    check_address(args.host, args.port)
    import uvicorn

    from ..server.app import Settings, create_app
    options = method_args(args)
    sk = load_spekit(args, args.method, args.draft, rows=args.max_batch_size, **options)
    announce_auto(sk, args)
    use_chat_template(sk, args)
    context = sk.target.max_positions - 1
    if args.max_prompt_tokens is not None and not 1 <= args.max_prompt_tokens <= context:
        raise UserError(f"--max-prompt-tokens must be in [1, {context}] for this model")
    settings = Settings(model_id=args.served_model_name or args.model,
                        max_prompt_tokens=args.max_prompt_tokens or context, max_new_tokens=args.max_new_tokens,
                        max_batch_size=args.max_batch_size, max_body_bytes=args.max_body_bytes,
                        api_key=args.api_key, method=args.method, options=tuple(sorted(options.items())))
    app = create_app(sk, settings)
    print(f"[spekit] serving {settings.model_id} ({args.method}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
