"""Drafting methods. Every module in this package registers its proposer on import; adding a method is adding
a file."""
import importlib
import pkgutil

from .base import REGISTRY, Proposer, SideNodes, StepContext, get, register

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in ("base", "plugins"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["REGISTRY", "Proposer", "SideNodes", "StepContext", "get", "register"]
