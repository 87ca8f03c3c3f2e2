"""Trainable drafter heads (Medusa heads, EAGLE layers, MTP modules ...): one contract for building, training,
saving and loading them, shared by the proposers that draft with them and by `spekit train`.

A head directory holds `model.safetensors` (the head's own weights, never the target's) and `config.json`:
    {"kind": "eagle", "config": {...the head's frozen config...},
     "target": {"name": ..., "vocab_size": ..., "hidden_size": ..., "num_layers": ...},
     "meta": {"tau": ..., "trained_on": ..., "command": ...}}
Loading checks that the head fits the target and names the mismatch when it does not.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import UserError, can_write_in, folder_kind, read_json_object, usual_modes
from ..backends.draft_vocab import most_frequent

HEADS: dict[str, type["Head"]] = {}
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "heads"    # drafters shipped per model: <model>/<kind>
SHAPE = ("vocab_size", "hidden_size", "num_layers")


def register_head(cls: type["Head"]) -> type["Head"]:
    HEADS[cls.kind] = cls
    return cls


@dataclass
class FeatureBatch:
    """Training data for a head: token sequences with the target's hidden states along them.

    hidden[i] follows Hugging Face's `hidden_states` numbering: 0 is the embedding output, i the output of
    decoder layer i, and num_layers the LAST entry, which is after the final norm (lm_head(hidden[num_layers])
    gives the target's logits). Only the layers a head asks for (`feature_layers`) are present."""

    tokens: torch.Tensor                 # [B, L] long, right-padded
    loss_mask: torch.Tensor              # [B, L] bool: position t counts (its next token t+1 is a real token to learn)
    hidden: dict[int, torch.Tensor]      # layer index -> [B, L, H] float


def check_numbers(config, least: float = 0.0, *names: str) -> None:
    """UserError unless each named field of a head's Config is a finite number >= least (nan, inf refused)."""
    for name in names:
        value = getattr(config, name)
        if not least <= value < float("inf"):
            raise UserError(f"--{name.replace('_', '-')} must be a number >= {least:g}, got {value}")


def target_info(target) -> dict:
    """What a head records about the target it was made for (target: spekit.backends.torch_target.Target)."""
    cfg = target.config
    return {"name": getattr(cfg, "_name_or_path", "") or "", "vocab_size": target.vocab_size,
            "hidden_size": int(cfg.hidden_size), "num_layers": target.num_layers}


def shipped_dir(kind: str, target, accept=lambda info: True) -> Path | None:
    """The shipped drafter folder of this kind (medusa, eagle3, rest ...) made for a model of this target's shape
    (and that `accept(config)` takes), or None."""
    want = target_info(target)
    for config in sorted(SHIPPED.glob(f"*/{kind}/config.json")):
        info = json.loads(config.read_text())
        if all(info.get("target", {}).get(k) == want[k] for k in SHAPE) and accept(info):
            return config.parent
    return None


class Head(torch.nn.Module):
    """A drafter module trained against a frozen target. Subclasses set `kind`, `Config` (a frozen dataclass of
    JSON-friendly fields) and implement `create`, `feature_layers` and `training_loss`."""

    kind: ClassVar[str]
    Config: ClassVar[type]
    reconfigurable: ClassVar[frozenset[str]] = frozenset()   # Config fields that no trained weight depends on

    def __init__(self, config, target_config: dict):
        super().__init__()
        self.config, self.target_config = config, dict(target_config)

    def reconfigured(self, **changes) -> "Head":
        """A copy of this head with `reconfigurable` Config fields changed: the weights carry over; a buffer those
        fields resize (e.g. a draft vocabulary's token map) starts from its placeholder."""
        stray = sorted(set(changes) - self.reconfigurable)
        if stray:
            raise UserError(f"a trained '{self.kind}' head keeps its own "
                            f"{', '.join('--' + k.replace('_', '-') for k in stray)}")
        head = type(self)(dataclasses.replace(self.config, **changes), self.target_config)
        own = head.state_dict()
        head.load_state_dict({k: v for k, v in self.state_dict().items() if k in own and own[k].shape == v.shape},
                             strict=False)
        head.meta = getattr(self, "meta", {})
        return head

    @classmethod
    def create(cls, target, **options) -> "Head":
        """A fresh head for this target (spekit.backends.torch_target.Target); options are the Config's fields."""
        return cls(cls.Config(**options), target_info(target))

    def feature_layers(self) -> list[int]:
        """The hidden_states indices this head drafts from (see FeatureBatch)."""
        raise NotImplementedError

    def acceptance_options(self) -> dict | None:
        """Method options that make it draft at full depth whatever drafting costs, for the tau recorded at
        training (the drafter's acceptance); None: tau is measured as the method runs."""
        return None

    def training_layers(self) -> list[int]:
        """The hidden_states indices its training batches need: the drafting features, and whatever the loss
        reads besides (EAGLE-3's soft labels come from the last layer)."""
        return self.feature_layers()

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss to minimise and named figures to show (e.g. top-1 accuracy per head / step)."""
        raise NotImplementedError


class DraftVocab:
    """For a head whose Config has `draft_vocab` (0: the target's whole vocabulary): `token_map` [Vd], the target
    ids it drafts over, a buffer saved with the head, which starts as a placeholder (the lowest ids) until
    `choose_vocab` makes it the most frequent answer tokens (the trainer calls it once, before training)."""

    def add_token_map(self) -> None:
        """Called by the head's __init__: the placeholder map, when the config asks for a draft vocabulary."""
        if self.config.draft_vocab:
            self.register_buffer("token_map", torch.arange(self.config.draft_vocab))

    def choose_vocab(self, token_counts: torch.Tensor) -> None:
        """The draft vocabulary: the `draft_vocab` most frequent tokens of token_counts [V]."""
        if self.config.draft_vocab:
            self.token_map.copy_(most_frequent(token_counts, self.config.draft_vocab).to(self.token_map.device))

    @property
    def vocab_chosen(self) -> bool:
        """False while a draft vocabulary is still the placeholder (before choose_vocab)."""
        return not self.config.draft_vocab or not torch.equal(self.token_map.cpu(),
                                                              torch.arange(self.config.draft_vocab))


def save_head(head: Head, directory: str | Path, meta: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the head's weights and config.json into `directory`, atomically (temporary folder, then rename);
    `dtype` stores the floating-point tensors in that type (index buffers keep theirs)."""
    info = {"kind": head.kind, "config": dataclasses.asdict(head.config), "target": head.target_config,
            "meta": meta or {}}
    state = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in head.state_dict().items()}
    return write_dir(directory, state, info)


def _what(kind: str) -> str:
    return {"export": "an export for a serving engine", "datastore": "a datastore", "draft": "a draft model"}.get(
        kind, f"'{kind}' heads")


def check_out(directory: str | Path, kind: str | None, source: str | Path | None = None,
              flag: str = "--out") -> Path:
    """Refuse, before any work, an output folder that spekit cannot write or must not replace: a file; a folder
    holding anything but what spekit wrote there before as `kind` (the new folder replaces it whole; kind None: a
    folder files are added to, whatever it holds); the `source` folder the output is made from, or a place inside
    it; a place below a file, or where it cannot write."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a folder")
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()
        if dst == src or src in dst.parents:
            raise UserError(f"{flag} {out} is {'' if dst == src else 'inside '}{source}, the folder it is made "
                            f"from; give another folder")
    if kind is not None and out.is_dir() and any(out.iterdir()):
        try:
            found = folder_kind(json.loads((out / "config.json").read_text(encoding="utf-8")))
        except (OSError, ValueError):
            found = None
        if found is None:
            raise UserError(f"{flag} {out} is a folder with other files in it; give a new or empty folder (spekit "
                            f"replaces only a folder it wrote)")
        if found != kind:
            raise UserError(f"{flag} {out} holds {_what(found)}, and this writes {_what(kind)}: give another folder")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UserError(f"{flag} {out} cannot be replaced: it is not writable")
    place = out.absolute() if kind is None else out.absolute().parent     # where files are made
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise UserError(f"{flag} {out}: {place} is a file, not a folder")
    if not can_write_in(place):
        raise UserError(f"{flag} {out}: cannot write in {place}")
    return out


def replace_dir(tmp: Path, directory: Path) -> None:
    """Move the finished folder `tmp` to `directory`, replacing what is there (moved aside, then removed): a reader
    sees the old folder or the new one, never half of either."""
    if not directory.exists():
        os.replace(tmp, directory)
        return
    old = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(directory, old)
    try:
        os.replace(tmp, directory)
    except OSError:
        os.replace(old, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(directory: Path):
    """A temporary folder beside `directory` to write a checkpoint into; when the block ends cleanly it replaces
    `directory` (replace_dir), so a crash never leaves a half-written checkpoint. A failure to write is a
    UserError, and the temporary folder is removed either way."""
    tmp = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        yield tmp
        usual_modes(tmp)
        replace_dir(tmp, directory)
    except OSError as err:
        raise UserError(f"cannot write {directory} ({err.strerror or err})") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_dir(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`model.safetensors` and `config.json` into `directory` through staged_dir (replacing a folder spekit wrote
    there before as the same kind, see check_out)."""
    directory = check_out(directory, folder_kind(config) or "?")
    with staged_dir(directory) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def read_config(directory: str | Path) -> dict:
    """A head folder's config.json: UserError naming the file when it is missing, not JSON, not a head's."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} is not a spekit head directory (no config.json)")
    info = read_json_object(path, "head config", "a spekit head's config (a JSON object with kind, config and target)")
    if info.get("kind") not in HEADS:
        raise UserError(f"{path}: unknown head kind {info.get('kind')!r}; known: {', '.join(sorted(HEADS))}")
    check_fields(path, info, "config")
    return info


def head_config(info: dict, directory: str | Path):
    """The head's Config from a config.json read by read_config; UserError when its fields do not fit."""
    try:
        return HEADS[info["kind"]].Config(**info["config"])
    except TypeError as err:
        raise UserError(f"{Path(directory) / 'config.json'}: its 'config' does not fit a '{info['kind']}' head "
                        f"({err})") from None


def check_fields(path: Path, info: dict, *objects: str) -> None:
    """UserError naming `path` unless info holds each of `objects` and a "target" with the model's shape as JSON
    objects, and "meta" (when present) is one."""
    for key in (*objects, "target"):
        if not isinstance(info.get(key), dict):
            raise UserError(f"{path} has no '{key}' object; it is not a config spekit wrote (or it was edited)")
    bad = [k for k in SHAPE if not isinstance(info["target"].get(k), int)]
    if bad:
        raise UserError(f"{path}: 'target' lacks the model's {', '.join(bad)}")
    if not isinstance(info.setdefault("meta", {}), dict):
        raise UserError(f"{path}: 'meta' is not a JSON object")


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a folder's model.safetensors; UserError when it is missing, corrupt or truncated."""
    weights = Path(directory) / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} is missing")
    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(f"{weights} cannot be read ({err}); the file is corrupt or truncated") from None


def check_made_for(recorded: dict, target, what: str, remedy: str) -> None:
    """UserError "<what> (<key> A, this model has B); <remedy>" unless `recorded` (a folder's "target") has this
    target's shape."""
    want = target_info(target)
    for key in SHAPE:
        if recorded.get(key) != want[key]:
            raise UserError(f"{what} ({key} {recorded.get(key)}, this model has {want[key]}); {remedy}")


# the reader of the layouts that are not spekit's own (spekit.heads.published puts its reader here on import; the
# package imports every head module, so it is there whenever a head is loaded)
OTHER_LAYOUTS: list[Callable] = []


def is_spekit_dir(directory: str | Path) -> bool:
    """Whether `directory` is to be read as spekit's own head layout (config.json with a head "kind"); a missing
    folder and a config.json that is not a readable JSON object count as spekit's, so that read_config names what
    is wrong. A folder of another layout, or with no config.json, goes to spekit.heads.published."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        return True
    if not path.is_file():
        return False
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return not isinstance(info, dict) or "kind" in info


def load_head(directory: str | Path, target, kind: str | None = None) -> Head:
    """Load a head for this target, checking that it was made for a model of the same shape. A folder in another
    layout (a published EAGLE / EAGLE-3 / Medusa / MTP drafter, the speculators format) goes to
    spekit.heads.published, which checks it the same way."""
    if not is_spekit_dir(directory):
        return OTHER_LAYOUTS[0](directory, target, kind)
    info = read_config(directory)
    if kind is not None and info["kind"] != kind:
        raise UserError(f"{directory} holds a '{info['kind']}' head, not '{kind}'")
    check_made_for(info["target"], target, f"{directory} was trained for another model",
                   f"train heads for it with `spekit train {info['kind']}`")
    cls = HEADS[info["kind"]]
    head = cls(head_config(info, directory), info["target"])
    state = read_weights(directory)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{directory}/model.safetensors does not fit a '{info['kind']}' head "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    head.meta = info.get("meta", {})
    return head.to(device=target.device).eval()


class TargetShell:
    """Enough of a Target for `load_head` and `Head.create` when only a head directory is at hand."""

    def __init__(self, target_config: dict):
        self.vocab_size = target_config["vocab_size"]
        self.num_layers = target_config["num_layers"]
        self.config = type("C", (), {"hidden_size": target_config["hidden_size"]})()
        self.device = torch.device("cpu")
