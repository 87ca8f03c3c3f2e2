"""Sweeps: the same benchmark under one setting varied at a time (`--sweep batch=1,2,4`, `--sweep
num_draft_tokens=2,4,8`, `--sweep temperature=0,0.7,1.0`, `--sweep dtype=float32,bfloat16`; any sampling field
or method option). Sweeps measure spekit's methods (the peers run at the base settings only); each value has its
own answers folder, so a stopped sweep resumes too."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import UserError
from ..backends.torch_models import DTYPES
from ..backends.weight_quant import SCHEMES
from ..proposers import REGISTRY
from .contestants import options_for
from .peers import PEERS
from .runner import Settings, measure
from .variants import method_of

AXES = {"batch": int, "temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "dtype": str,
        "quantize": str, "repetition_penalty": float, "frequency_penalty": float, "presence_penalty": float,
        "verification": str, "relaxed": float}


def option_types() -> dict[str, type]:
    """Method option name -> its type, over every registered method."""
    out: dict[str, type] = {}
    for cls in REGISTRY.values():
        for f in dataclasses.fields(cls.Options):
            out.setdefault(f.name, type(f.default))
    return out


def parse_sweep(spec: str) -> tuple[str, list]:
    """'key=v1,v2,...' -> (key, typed values). A bad spec is a UserError naming what is allowed."""
    key, sep, raw = spec.partition("=")
    key = key.strip().replace("-", "_")
    kinds = {**AXES, **option_types()}
    if not sep or not raw.strip():
        raise UserError(f"bad sweep spec {spec!r}: write KEY=V1,V2,... (e.g. batch=1,2,4)")
    if key not in kinds:
        raise UserError(f"bad sweep spec {spec!r}: cannot sweep {key!r}; sweepable: {', '.join(sorted(kinds))}")
    kind = kinds[key]
    values = []
    for text in raw.split(","):
        text = text.strip()
        try:
            values.append(kind(text) if kind is not bool else text.lower() in ("1", "true", "yes"))
        except ValueError:
            raise UserError(f"bad sweep spec {spec!r}: {text!r} is not a {kind.__name__}") from None
    if key == "dtype" and any(v not in DTYPES for v in values):
        raise UserError(f"bad sweep spec {spec!r}: dtype must be one of {', '.join(DTYPES)}")
    if key == "quantize" and any(v not in SCHEMES for v in values):
        raise UserError(f"bad sweep spec {spec!r}: quantize must be one of {', '.join(SCHEMES)}")
    if len(set(values)) != len(values):
        raise UserError(f"bad sweep spec {spec!r}: a value is repeated")
    return key, values


def check_values(base: Settings, names: list[str] | None, sweeps: list[tuple[str, list]]) -> None:
    """Every swept setting is valid: a bad value is refused before any run, not after the base run's minutes."""
    for key, values in sweeps:
        for value in values:
            s = base.with_value(key, value)
            try:
                if s.batch < 1:
                    raise UserError(f"batch must be >= 1, got {s.batch}")
                s.sampling()
                for m in sweep_methods(key, names):
                    REGISTRY[method_of(m)].Options(**options_for(m, s.options))
            except UserError as err:
                raise UserError(f"bad sweep value {key}={value}: {err}") from None


def sweep_methods(key: str, names: list[str] | None) -> list[str]:
    """spekit methods measured by a sweep over `key`: those taking the option (and plain, the baseline)."""
    methods = [n for n in (names or sorted(REGISTRY)) if n not in PEERS]
    if key in AXES:
        return methods
    takers = [m for m in methods if key in {f.name for f in dataclasses.fields(REGISTRY[method_of(m)].Options)}]
    return ["plain"] + [m for m in takers if m != "plain"]


def run_sweeps(base: Settings, questions: list[dict], names: list[str] | None, folder: Path,
               sweeps: list[tuple[str, list]]) -> list[dict]:
    out = []
    for key, values in sweeps:
        runs = []
        for value in values:
            s = base.with_value(key, value)
            report = measure(s, questions, sweep_methods(key, names), folder / "answers" / f"{key}={value}",
                             desc=f"{key}={value}")
            runs.append(report)
        out.append({"axis": key, "values": values, "runs": runs})
    return out
