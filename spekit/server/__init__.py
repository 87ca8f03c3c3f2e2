"""`spekit serve`: an OpenAI-compatible HTTP server over the engine, with continuous batching (`spekit.batching`).

    app.py        FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    guard.py      ASGI middleware: API key (401), body size (413), request counts
    schemas.py    request validation and OpenAI-shaped responses and errors
    text.py       incremental detokenization and text stop sequences
    scheduler.py  the worker thread that steps one Session per (method, options, sampling settings)
    metrics.py    Prometheus text exposition
    cli.py        the `serve` subcommand and its binding rules
"""
