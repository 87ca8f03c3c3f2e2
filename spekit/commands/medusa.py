"""`spekit medusa tree DIR`: rebuild the static draft tree stored with Medusa heads from their measured accuracies."""
from __future__ import annotations

from pathlib import Path

from ..config import UserError
from ..heads import read_config
from ..proposers.medusa import MAX_NODES, best_paths, stored_accuracy


def add_medusa_parser(sub) -> None:
    """`spekit medusa tree DIR`: rebuild the static tree stored with Medusa heads from their measured accuracies."""
    p = sub.add_parser("medusa", help="Medusa heads: rebuild the static draft tree stored with them")
    p.add_argument("action", choices=["tree"])
    p.add_argument("heads", metavar="DIR", help="a Medusa head directory")
    p.add_argument("--nodes", type=int, default=64, help=f"draft nodes in the tree, 1..{MAX_NODES} (default: 64)")
    p.set_defaults(run=run_medusa)


def run_medusa(args) -> None:
    import json
    import os
    from ..heads.base import head_config
    if not 1 <= args.nodes <= MAX_NODES:
        raise UserError(f"--nodes must be in 1..{MAX_NODES} (each step verifies up to that many drafted tokens), "
                        f"got {args.nodes}")
    info = read_config(args.heads)
    if info["kind"] != "medusa":
        raise UserError(f"{args.heads} holds a '{info['kind']}' head, not Medusa heads")
    meta = info["meta"]
    accuracy = stored_accuracy(meta, head_config(info, args.heads).num_heads, args.heads)
    meta["tree"] = best_paths(accuracy, args.nodes)
    path = Path(args.heads) / "config.json"
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(f"{path} cannot be rewritten: it or its folder is read-only")
    tmp = path.with_name(".config.json.tmp")
    try:
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise UserError(f"cannot rewrite {path} ({err.strerror or err})") from None
    finally:
        tmp.unlink(missing_ok=True)
    depth = max(len(p) for p in meta["tree"])
    print(f"{path}: tree of {len(meta['tree'])} nodes, depth {depth}, expected tokens per step at full size "
          f"{1 + sum(_value(accuracy, p) for p in meta['tree']):.2f}")


def _value(accuracy: list[list[float]], path: list[int]) -> float:
    out = 1.0
    for d, c in enumerate(path):
        out *= accuracy[d][c]
    return out
