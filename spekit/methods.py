"""Method name -> proposer -> engine, written once: the Python API, the `model.generate` drop-in and the server build
their engines here. `auto` resolves to a method from what the model has here, without measuring (`spekit advise`
measures)."""
from __future__ import annotations

import dataclasses

from .config import UserError
from .engine import Engine
from .proposers import get as get_method

AUTO = "auto"


def resolve_method(method: str, target) -> tuple[str, str | None]:
    """(the method to run, why auto chose it): `method` itself unless it is "auto"."""
    return auto_method(target) if method == AUTO else (method, None)


def auto_method(target) -> tuple[str, str]:
    """`--method auto`: the method picked from what this model has here (the rules of the selection table that
    `spekit advise --explain` prints), without measuring (`spekit advise` measures). Returns (method, why)."""
    from .heads.base import shipped_dir
    from .heads.mtp_native import native_count
    if getattr(target, "backend", "torch") == "llama.cpp":
        # a wide forward costs nearly its width there, so the drafter whose drafts are copies does best (the
        # benchmark in docs/LLAMACPP.md)
        return "ngram", "on llama.cpp, where a wide forward costs nearly its width: prompt lookup, whose drafts are copies"
    if native_count(target.model):
        return "mtp", "the model has its own multi-token-prediction layers"
    if shipped_dir("rest", target) is not None:
        return "rest", "a datastore of this model's own answers ships with spekit"
    if shipped_dir("eagle3", target) is not None:
        return "eagle3-lookup", "EAGLE-3 heads ship for this model"
    return "rest", "no drafter ships for this model: retrieval from the context and the earlier answers"


def method_options(method: str, options: dict):
    """Build the method's frozen options from the given (non-None) values; a value the method does not take is
    an error, not silently ignored."""
    cls = get_method(method).Options
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in options.items() if v is not None}
    stray = sorted(set(given) - names)
    if stray:
        flags = ", ".join("--" + s.replace("_", "-") for s in stray)
        raise UserError(f"method '{method}' does not take {flags}")
    return cls(**given)


def backend_refusal(target, cls) -> str | None:
    """Why a method cannot run on this target's backend (None: it can)."""
    if getattr(target, "backend", "torch") != "llama.cpp":
        return None
    from .backends.llama_model import refusal
    return refusal(cls)


def build_engine(target, method: str, options: dict | None = None, draft=None, *, stop_ids: tuple[int, ...] = (),
                 grammars=None, tokenizer=None) -> Engine:
    """The engine that runs `method` (a resolved name, not "auto") on `target`: its proposer built from `options`
    (a dict of the method's option values, None entries meaning its default, or its Options), with `draft` (a
    target of the same backend) for the methods that need a draft model. A method the backend cannot run, or a
    draft given to a method that takes none, is a UserError (a missing one: the proposer says so). tokenizer: the
    target's, for a draft model of another vocabulary (which carries its own as `draft.tokenizer`)."""
    cls = get_method(method)
    refused = backend_refusal(target, cls)
    if refused:
        raise UserError(refused)
    if draft is not None and not cls.needs_draft_model:
        raise UserError(f"method '{method}' does not use a draft model (--draft)")
    opts = options if isinstance(options, cls.Options) else method_options(method, options or {})
    return Engine(target, cls.build(target, opts, draft, tokenizer), stop_ids=stop_ids, grammars=grammars)
