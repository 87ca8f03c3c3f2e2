"""Step costs kept between runs: what a forward over n new tokens costs on this machine, for this model, dtype and
fast path (`step_costs.StepCosts`), written after each generation and read when the next process loads the same
model.

Without them every process times forwards over 1, 2, 4 and 8 tokens before its first draft (`Pacer.calibrate`),
a sizeable share of a short answer's time, paid again by every command run once per prompt
(`python scripts/cold_start.py` measures the difference).

A profile is keyed by everything that changes the cost of a forward: the architecture (the model's config without
its name), the weights' dtype and packing, the fast-path forms, compile and CUDA graphs, the device (the CPU's model
name and torch's thread count, or the GPU's name), torch's version and `VERSION` below (bump it when spekit's
forward changes). Weights are not in the key: a fine-tuned model of the same shape costs the same. Only ratios
between figures of the same run are used (`StepCosts._ratio`), and this run's measurements replace a stored figure
as soon as they exist, so a machine that runs slower today than when the profile was written still sizes its
drafts right. A profile that cannot be read is ignored (the engine calibrates as before); one that cannot be
written is skipped with a warning. Files are written whole (temporary file, then rename).

Where: `$SPEKIT_CACHE/costs/` (default `~/.cache/spekit/models/costs/`, beside the dequantized models), or a file
named by `--cost-profile FILE`; `--cost-profile none` keeps nothing between runs. `--cost-profile flat` keeps nothing
either and prices every forward as a one-token one (`StepCosts.make_flat`): drafters then draft their widest at every
step, which measures their acceptance on full trees (τ as the papers report it) rather than this machine's speed.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ..config import UserError
from .step_costs import StepCosts

VERSION = 1                 # of spekit's forward as far as its cost goes, and of this file's format
SAVE_EVERY_S = 10.0         # a server writes at most this often; a generation's end always may


def fingerprint(*, model: str, config: dict, dtype: str, packed_bits: list[int], device: torch.device,
                invariant: bool, compiled: bool, captures: bool) -> dict:
    """What a forward's cost depends on (see the module docstring), from the facts the target passes: its model
    class's name, its config (as a dict), its weights' dtype name, the bit widths of its packed layers ([] where
    none) and its device."""
    config = dict(config)
    for volatile in ("_name_or_path", "transformers_version", "name_or_path", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    return {"version": VERSION, "torch": torch.__version__, "model": model,
            "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
            "dtype": dtype, "packed_bits": sorted(packed_bits), "invariant": invariant,
            "compiled": compiled, "cuda_graphs": captures, "device": _device(device)}


def _device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu_name()}:{torch.get_num_threads()} threads"


def cpu_device() -> str:
    """The CPU's model name: what a step's cost on it depends on beside the thread count."""
    return f"cpu:{_cpu_name()}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_path(key: dict, folder: Path) -> Path:
    """The profile's file for `key` under `folder` (the target's cache folder)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / "costs" / f"{key['model']}-{key['dtype']}-{digest}.json"


def attach(costs: StepCosts, key: dict, where: str = "auto", folder: Path | None = None) -> None:
    """Tie `costs` to its profile: read the stored figures (when the file holds this key) and remember where to
    write. where: "auto" (the default path for the key under `folder`, the target's cache folder), "none" (keep
    nothing), "flat" (keep nothing, every width
    priced as one token: StepCosts.make_flat), or a file path. A file named by the
    user that holds a profile of another setup is said so in a warning and replaced after the run; a folder, or a
    file that is not a profile at all, is a UserError (nothing is written over it)."""
    if where in ("none", "flat"):
        costs.profile = None
        if where == "flat":
            costs.make_flat()
        return
    named = where != "auto"
    path = Path(where).expanduser() if named else default_path(key, folder)
    if path.is_dir():
        raise UserError(f"--cost-profile {where}: is a folder; name a file (or auto / none)")
    costs.profile = (path, key)
    if not path.exists():
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        data = err
    if named and not (isinstance(data, dict) and "key" in data and "entries" in data):
        # not a profile at all: a file of the user's own, which this run must not overwrite
        raise UserError(f"--cost-profile {where}: the file exists and is not a step-cost profile; name a new "
                        f"file, a profile, auto or none")
    try:
        if isinstance(data, Exception):
            raise data
        if not isinstance(data, dict) or data.get("key") != key:
            raise ValueError("measured for another model, dtype, fast path or machine")
        costs.restore(data.get("entries", []), data.get("calibrated", []))
    except (OSError, ValueError, TypeError) as err:
        costs.stored.clear()
        costs.calibrated.clear()
        if named:
            warnings.warn(f"{path} is not a step-cost profile of this setup ({err}); measuring afresh, and it "
                          f"will be replaced", stacklevel=3)


def save(costs: StepCosts, force: bool = False) -> None:
    """Write the profile if anything was measured since the last write (at most every SAVE_EVERY_S unless
    forced)."""
    if costs.profile is None or not costs.changed:
        return
    now = time.monotonic()
    if not force and costs.saved_at is not None and now - costs.saved_at < SAVE_EVERY_S:
        return
    path, key = costs.profile
    data = {"key": key, "calibrated": sorted(costs.calibrated), "entries": costs.entries(),
            "columns": ["batch bucket", "new tokens per row bucket", "context bucket", "seconds (median)"]}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"could not keep the measured step costs in {path}: {err}", stacklevel=2)
        costs.profile = None                    # do not try again every step
        return
    costs.changed, costs.saved_at = False, now
