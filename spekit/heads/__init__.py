"""Trainable drafter heads; every module of this package registers its head kinds on import."""
import importlib
import pkgutil

from .base import HEADS, FeatureBatch, Head, load_head, read_config, register_head, save_head, target_info

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["HEADS", "FeatureBatch", "Head", "load_head", "read_config", "register_head", "save_head",
           "target_info"]
