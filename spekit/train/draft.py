"""The `draft` kind: a small Llama with the target's vocabulary, distilled from the target."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftConfig:
    layers: int = 2            # decoder layers, initialised from evenly spaced target layers
    ce_weight: float = 0.5     # loss = KL(target || draft) + ce_weight * CE(target's greedy token)


class DraftHead(torch.nn.Module):
    kind = "draft"
    Config = DraftConfig
