"""An exit adapter for self-speculative early exit (`spekit train exit`, `--method early-exit --heads DIR`): a
small residual block on the hidden state after the target's first E layers, trained so that the target's own
final norm and LM head read the whole model's next token off it (LayerSkip, Elhoushi et al. 2024, trains the
model itself for this; here only the adapter learns, the target stays frozen).

The block is `num_layers` residual SiLU layers (x + SiLU(W x + b)), zero-initialised: untrained, the adapter is the
identity and early exit drafts as it does without one. It is trained by self-distillation on the target's own
answers: the cross-entropy of its prediction at every answer position against the target's distribution there
(before any final logit soft-capping, which drafting then applies as the model does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from .base import FeatureBatch, Head, register_head
from .medusa import ResidualBlock, target_lm_weight


@dataclass(frozen=True)
class ExitConfig:
    exit_layer: int = 0             # the adapter reads the hidden state after layers 0..exit_layer-1; 0 = half
    num_layers: int = 1             # residual layers in the block

    def __post_init__(self) -> None:
        if self.exit_layer < 0 or self.num_layers < 1:
            raise UserError(f"need exit_layer >= 1 (0 = half the layers) and num_layers >= 1, got "
                            f"{self.exit_layer}, {self.num_layers}")


@register_head
class ExitHead(Head):
    kind = "exit"
    Config = ExitConfig

    def __init__(self, config: ExitConfig, target_config: dict):
        super().__init__(config, target_config)
        layers = target_config["num_layers"]
        if config.exit_layer and not 1 <= config.exit_layer < layers:
            raise UserError(f"exit_layer must be in 1..{layers - 1} for this model ({layers} layers), got "
                            f"{config.exit_layer}")
        self.block = ResidualBlock(target_config["hidden_size"], config.num_layers)

    @classmethod
    def create(cls, target, **options) -> "ExitHead":
        layer = options.get("exit_layer") or target.num_layers // 2
        return super().create(target, **{**options, "exit_layer": layer})

    def feature_layers(self) -> list[int]:
        return [self.config.exit_layer]

    def training_layers(self) -> list[int]:
        return [self.config.exit_layer, self.target_config["num_layers"]]     # the last one: the teacher

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:      # [..., H] after exit_layer layers -> [..., H]
        return self.block(hidden)

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_mask                                                        # [B, L]
        h = batch.hidden[self.config.exit_layer][mask]                                # [M, H] after layer E
        final = batch.hidden[self.target_config["num_layers"]][mask]                  # [M, H] after the norm
        weight = target_lm_weight(target).to(h.dtype)                                 # [V, H]
        norm = target.model.get_decoder().norm                                       # the target's final norm
        with torch.no_grad():
            teacher = torch.nn.functional.linear(final, weight).float().softmax(-1)  # [M, V]
        pred = torch.nn.functional.linear(norm(self.block(h)), weight).float()     # [M, V]
        loss = -(teacher * pred.log_softmax(-1)).sum(-1).mean()
        with torch.no_grad():
            untrained = torch.nn.functional.linear(norm(h), weight).argmax(-1)
            best = teacher.argmax(-1)
        return loss, {"loss": float(loss.detach()), "top1": float((pred.argmax(-1) == best).float().mean()),
                      "top1_untrained": float((untrained == best).float().mean())}
