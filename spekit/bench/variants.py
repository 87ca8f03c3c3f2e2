"""Method variants: a method under option values of its own, measured as a contestant of its own beside the
method with the run's options (`--methods plain,rest,rest:tree-size=12:recycle=0`, `eagle3:heads=runs/new`).
Settings of one method, or two trained heads, are then compared in one run (with `--lockstep`, step by step on the
same prompts, so that a shared machine's drifts hit them alike) instead of in separate runs minutes apart, whose
drifts on a busy CPU are as large as the 1-3% a setting moves.

A variant's name is METHOD, then `:OPTION=VALUE` per option (the method's own options, named as its flags
are, `tree-size` or `tree_size`); its values take precedence over the run's flags (and over a swept option)."""
from __future__ import annotations

import dataclasses

from ..config import UserError
from ..proposers import REGISTRY

SEP = ":"
HOW = "write METHOD:OPTION=VALUE[:OPTION=VALUE...], e.g. rest:tree-size=12"


def method_of(name: str) -> str:
    """The method a contestant's name runs ('rest' for 'rest:tree-size=12')."""
    return name.partition(SEP)[0].strip()


def parse(name: str) -> tuple[str, dict]:
    """'rest:tree-size=12:recycle=0' -> ('rest', {'tree_size': 12, 'recycle': 0}); a plain name -> (name, {}).
    A bad variant is a UserError naming what the method takes."""
    method, sep, text = name.partition(SEP)
    method = method.strip()
    if not sep:
        return method, {}
    if method not in REGISTRY:
        raise UserError(f"bad method variant {name!r}: {method!r} is not a spekit method (peers take no options); "
                        f"methods: {', '.join(sorted(REGISTRY))}")
    fields = {f.name: f for f in dataclasses.fields(REGISTRY[method].Options)}
    given: dict = {}
    for item in text.split(SEP):
        key, eq, raw = item.partition("=")
        key, raw = key.strip().replace("-", "_"), raw.strip()
        if not eq or not key or not raw:
            raise UserError(f"bad method variant {name!r}: {HOW}")
        if key not in fields:
            takes = ", ".join(f.replace("_", "-") for f in fields) or "no options"
            raise UserError(f"bad method variant {name!r}: {method} has no option {key.replace('_', '-')!r}; "
                            f"it takes: {takes}")
        if key in given:
            raise UserError(f"bad method variant {name!r}: {key.replace('_', '-')} is given twice")
        given[key] = _typed(fields[key], raw, name)
    return method, given


def _typed(field: dataclasses.Field, raw: str, name: str):
    kind = type(field.default)
    if kind is bool:
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise UserError(f"bad method variant {name!r}: {field.name.replace('_', '-')} takes true or false")
        return raw.lower() in ("1", "true", "yes")
    try:
        return kind(raw)
    except ValueError:
        raise UserError(f"bad method variant {name!r}: {raw!r} is not a {kind.__name__} "
                        f"({field.name.replace('_', '-')})") from None


def options(name: str, common: dict) -> dict:
    """The options a contestant runs with: those of the run (`common`, by field name) its method takes, then the
    variant's own over them."""
    method, own = parse(name)
    takes = {f.name for f in dataclasses.fields(REGISTRY[method].Options)}
    return {**{k: v for k, v in common.items() if k in takes and v is not None}, **own}


def check(names: list[str], common: dict) -> None:
    """Every variant builds its method's options (values in range, ...), and no contestant is named twice:
    refused before a model loads."""
    seen: dict[tuple, str] = {}
    for name in names:
        method, own = parse(name)
        if method not in REGISTRY:
            continue
        try:
            REGISTRY[method].Options(**options(name, common))
        except UserError as err:
            raise UserError(f"bad method variant {name!r}: {err}") from None
        key = (method, tuple(sorted(own.items())))
        if key in seen:
            raise UserError(f"--methods names the same contestant twice: {seen[key]!r} and {name!r}")
        seen[key] = name
