"""Methods from outside spekit: a module that subclasses `spekit.proposers.Proposer` and decorates it with
`@register` becomes a method like the shipped ones (`generate --method`, `bench`, `advise`, `serve`, its options
as flags) once it is imported. Two ways to have it imported:

- an installed package names it in the entry-point group `spekit.methods` (pyproject.toml:
  `[project.entry-points."spekit.methods"] mine = "my_package.my_method"`); one that fails to load is skipped
  with a warning, so a broken add-on cannot take spekit down;
- the environment variable SPEKIT_PLUGINS lists module names or .py files (separated by os.pathsep): what you
  name yourself must load, or the command stops with its error.

A plugin cannot take a method name spekit (or another plugin) has: `register` refuses it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

from ..config import UserError

ENV = "SPEKIT_PLUGINS"
GROUP = "spekit.methods"
_done = False


def load_plugins() -> None:
    """Import the installed and the named method plugins, once per process (UserError for a named one that does
    not load)."""
    global _done
    if _done:
        return
    _done = True
    # the shipped methods are registered first (their names are taken): importing this module imported the package
    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001 (anything an add-on raises)
            warnings.warn(f"the method plugin '{ep.name}' ({ep.value}) did not load and is skipped: "
                          f"{type(err).__name__}: {err}")
    for item in filter(None, os.environ.get(ENV, "").split(os.pathsep)):
        _load(item)


def _load(item: str) -> None:
    if item.endswith(".py") and not Path(item).is_file():
        raise UserError(f"{ENV} names {item}, which is not a file")
    try:
        if item.endswith(".py"):
            path = Path(item)
            name = f"spekit_plugin_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(item)
    except UserError as err:
        raise UserError(f"{ENV}: {item}: {err}") from None
    except Exception as err:  # noqa: BLE001
        raise UserError(f"{ENV}: {item} did not load: {type(err).__name__}: {err}") from None
