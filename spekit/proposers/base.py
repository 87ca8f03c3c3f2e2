"""The proposer (drafter) interface. A method is one module that subclasses `Proposer` and registers itself;
its needs are declared as class attributes, never special-cased in the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..acceptance import Verdict
from ..config import SamplingConfig, UserError
from ..costs import prior_cost
from ..target import Target
from ..tree import DraftTree

REGISTRY: dict[str, type["Proposer"]] = {}


def register(cls: type["Proposer"]) -> type["Proposer"]:
    REGISTRY[cls.name] = cls
    return cls


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass
class StepContext:
    """What a proposer may look at. Tokens are host lists: the committed context of each row, its last entry the
    pending token (chosen, not yet in the target's cache)."""

    tokens: list[list[int]]          # per row: prompt + generated so far
    pending: torch.Tensor            # [B] long, == tokens[b][-1]
    positions: torch.Tensor          # [B] long, position the pending token will take
    room: list[int]                  # per row: the deepest draft the context length still allows
    cfg: SamplingConfig
    gens: list[torch.Generator] | None
    target: Target
    # cost of a target forward over n tokens per row / over one, for this batch (costs.py). Under sampling it is
    # the batch-independent prior, and proposers decide per row, so that a row's sample never depends on its batch.
    cost: Callable[[int], float] = prior_cost


class Proposer:
    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    needs_draft_model: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False   # the target's hidden states are passed to begin / observe
    lossless: ClassVar[bool] = True
    speculates: ClassVar[bool] = True             # offers drafts (the engine then measures verification costs)
    help: ClassVar[str] = ""

    def __init__(self, target: Target, options, draft: Target | None = None):
        if self.needs_draft_model and draft is None:
            raise UserError(f"method '{self.name}' needs a draft model (--draft NAME|PATH)")
        self.target, self.options, self.draft = target, options, draft

    def begin(self, ctx: StepContext, hidden: tuple | None = None) -> None:
        """Called once after prefill, with the first generated token pending. hidden (when the proposer declares
        needs_hidden_states): the target's hidden states per layer, embeddings first, each [B, L, H] over the
        left-padded prompts."""

    def propose(self, ctx: StepContext) -> DraftTree:
        """A draft tree per row whose root is the pending token."""
        raise NotImplementedError

    def observe(self, ctx: StepContext, verdict: Verdict, gained: list[list[int]],
                hidden: tuple | None = None) -> None:
        """The verdict of the last step; `gained` holds each row's committed new tokens (accepted + next); hidden
        (when declared): the target's hidden states per layer at every tree node, each [B, N, H], to be gathered
        along verdict.path."""

    def select_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep the state of these rows, in this order."""

    def add_rows(self, ctx: StepContext, hidden: tuple | None = None) -> None:
        """New rows join the running batch after its last row (continuous batching, `spekit.session`): ctx and
        hidden describe the new rows only, as `begin` would see them. A proposer that keeps per-row state
        implements it; without it (this default) new rows wait until the running batch has drained."""
        raise NotImplementedError

    @classmethod
    def can_add_rows(cls) -> bool:
        return cls.add_rows is not Proposer.add_rows


def get(name: str) -> type[Proposer]:
    if name not in REGISTRY:
        raise UserError(f"unknown method '{name}'; available: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
