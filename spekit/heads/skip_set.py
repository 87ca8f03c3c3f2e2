"""The skip file of `--method layer-skip`: which layers the draft skips, for which model (a fingerprint of its shape and
embedding), written by `spekit layer-skip search`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import UserError, write_atomic

if TYPE_CHECKING:
    from ..backends.torch_target import Target

SAMPLE, SAME_WITHIN = 256, 0.01    # another model's embedding is ~1.4 off (relative); bfloat16's rounding ~0.002


FORMAT = "spekit-layer-skip/1"


def fingerprint(target: Target) -> dict:
    """What identifies a model in a skip file: its type and shape, and a sample of its input embedding. The
    embedding stays put under a change of dtype (bfloat16 rounds it by a part in 512) and under weight-only
    quantization (which packs the linear layers only), so a file searched in float32 serves the same model loaded
    in bfloat16 or int4 (an exact hash of the weights refused it there, or failed on the packed layers)."""
    flat = target.model.get_input_embeddings().weight.detach().flatten()
    at = torch.arange(SAMPLE, device=flat.device) * (flat.numel() // SAMPLE)       # [SAMPLE] spread evenly
    return {"type": target.config.model_type, "layers": target.num_layers, "vocab": target.vocab_size,
            "embedding_sample": flat[at].float().cpu().tolist()}


def same_model(recorded, target: Target) -> bool:
    """Whether a skip file's `model` entry describes this target (the sample within SAME_WITHIN, relative)."""
    mine = fingerprint(target)
    if not isinstance(recorded, dict) or any(recorded.get(k) != mine[k] for k in ("type", "layers", "vocab")):
        return False
    try:
        theirs = torch.tensor(recorded.get("embedding_sample"), dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return False
    ours = torch.tensor(mine["embedding_sample"])
    return theirs.shape == ours.shape and bool((theirs - ours).norm() <= SAME_WITHIN * ours.norm())


def save(path: str, target: Target, skipped: list[int], report: dict) -> None:
    """Write the skip file atomically (temporary name, then rename)."""
    data = {"format": FORMAT, "model": fingerprint(target), "num_layers": target.num_layers,
            "skip": sorted(skipped), **report}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def load(path: str, target: Target) -> tuple[list[int], float | None]:
    """The skipped layers of a skip file made for this model, and the first draft token's acceptance the search
    measured (None when the file does not say)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"no skip file at {path} (make one with: spekit layer-skip search)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the skip file {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("skip"), list):
        raise UserError(f"{path} is not a spekit layer-skip file")
    if isinstance(data.get("model"), str):           # an exact hash of the weights (the older format)
        raise UserError(f"the skip file {path} names its model as an older spekit did; run spekit layer-skip "
                        "search again")
    if not same_model(data.get("model"), target) or data.get("num_layers") != target.num_layers:
        raise UserError(f"the skip file {path} was made for another model; run spekit layer-skip search for this "
                        "one")
    skip = data["skip"]
    if not all(isinstance(i, int) and 0 <= i < target.num_layers for i in skip) or len(set(skip)) >= target.num_layers:
        raise UserError(f"the skip file {path} names layers this model does not have, or all of them")
    profile = data.get("acceptance_profile") or [None]
    first = profile[0] if isinstance(profile[0], (int, float)) and 0 <= profile[0] <= 1 else None
    return sorted(set(skip)), first
