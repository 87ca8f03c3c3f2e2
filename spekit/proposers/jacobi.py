"""Jacobi decoding: fixed-point iteration over a block of n guessed tokens (Santilli et al. 2023; consistency-trained
models, CLLM, Kou et al. 2024, converge in far fewer iterations).

Each step drafts the block as a chain under the pending token; the core's acceptance rule keeps the converged
prefix (the guesses the target agrees with) and the target's token after it, so output is exactly the target's
under greedy and sampling (point-mass drafts). The target's argmax at the block positions, read from the same
forward, gives the next guesses: node j's logits predict position p+1+j, so after a step that accepted a guesses
the guesses for the positions after the new pending token come from nodes a+1, a+2, ...; the block is topped up
with the last guess. Nothing model-specific: a CLLM checkpoint is used as it is.

Backing off: a model not trained for it rarely converges (tau near 1), and a forward over k tokens costs more than
one (ctx.budget.cost). Each row keeps decayed acceptance figures and drafts the block length that gives the most tokens
per unit of cost (`Budget.chain_widths`); where no length pays, the step is a plain one-token step. A row that backs
off drifts back towards trying (the text may turn predictable). Under sampling, where no timed guard may hold the
drafts back (the engine's governor is greedy-only), it drifts at half the pace after each block that failed in a
row, down to an eighth: at a fixed pace the block was still tried on a fifth of the steps on a model not trained for
it, 2-3% slower than plain. Greedy keeps the fixed pace, which finds the blocks a looping answer makes acceptable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import UserError
from ..pacing.odds import ChainOdds
from ..tree import DraftTree, chain
from .base import Proposer, StepContext, register


DRIFT = 0.02     # what a backed-off row's first-guess acceptance count gains per plain step, until a block fails


@dataclass(frozen=True)
class JacobiOptions:
    block_size: int = 4      # n: guessed tokens iterated (and verified) per step

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise UserError(f"block_size must be >= 1, got {self.block_size}")


@register
class Jacobi(Proposer):
    name = "jacobi"
    Options = JacobiOptions
    needs_logits = True
    help = "Jacobi decoding: iterate a block of guesses to its fixed point (no draft model; best with CLLM models)"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        if options.block_size >= target.max_positions:
            raise UserError(f"block_size {options.block_size} does not fit the model's context of "
                            f"{target.max_positions} tokens")

    def begin(self, ctx: StepContext, hidden=None) -> None:
        n = self.options.block_size
        self.guesses = [[t[-1]] * n for t in ctx.tokens]      # per row: guesses for the positions after pending
        # per row, the odds of its guesses (first, later given the one before); the prior is mildly optimistic, so
        # a row tries the block before it backs off
        self.odds = [ChainOdds(pace=DRIFT) for _ in ctx.tokens]
        self.widths = [0] * len(ctx.tokens)

    def propose(self, ctx: StepContext) -> DraftTree | None:
        rows = [(odds.accepted, min(len(g), room)) for odds, g, room in zip(self.odds, self.guesses, ctx.room)]
        # greedy: one width for the batch (every row pays for the widest draft); sampled: per row, so that a row's
        # sample does not depend on its batch
        self.widths = ctx.budget.chain_widths(rows)
        for odds, k in zip(self.odds, self.widths):
            if k == 0:
                odds.drift()
        width = max(self.widths)
        if width == 0:
            return None
        draft = [g[:k] + [0] * (width - k) for g, k in zip(self.guesses, self.widths)]
        device = ctx.pending.device
        return chain(ctx.pending, torch.tensor(draft, dtype=torch.long, device=device).view(len(draft), width),
                     torch.tensor(self.widths, device=device))

    def reads_plain_logits(self) -> bool:
        return any(self.widths)

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None, logits=None) -> None:
        # [B, N]: prediction for p+1+j; a step without a block reads nothing from it (and skips a device read)
        outputs = logits.argmax(dim=-1).tolist() if any(self.widths) else [[]] * len(self.widths)
        n = self.options.block_size
        for b, k in enumerate(self.widths):
            accepted = len(gained[b]) - 1
            fresh = (outputs[b][accepted + 1: k + 1] + self.guesses[b][k + 1:] or [gained[b][-1]])[:n]
            self.guesses[b] = fresh + [fresh[-1]] * (n - len(fresh))
            if k:
                self.odds[b].learn(accepted, k)
                if not ctx.cfg.greedy:     # (greedy steps have the engine's governor, timed, to hold them back)
                    self.odds[b].slow(DRIFT, accepted)

    def select_rows(self, rows: list[int]) -> None:
        self.guesses = [self.guesses[r] for r in rows]
        self.odds = [self.odds[r] for r in rows]
        self.widths = [self.widths[r] for r in rows]
