"""EAGLE-3 drafting (Li et al. 2025): the EAGLE-2 tree of `eagle.py`, drafted by an EAGLE-3 head (fused low,
middle and high features, direct prediction over a reduced draft vocabulary mapped back to target ids)."""
from __future__ import annotations

from .base import register
from .eagle import Eagle


@register
class Eagle3(Eagle):
    name = "eagle3"
    kind = "eagle3"
    help = "EAGLE-3: fused-feature head with a reduced draft vocabulary drafts a tree (--heads DIR, --tree ...)"
