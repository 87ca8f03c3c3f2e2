"""The proposer (drafter) interface. A method is one module that subclasses `Proposer` and registers itself;
its needs are declared as class attributes, never special-cased in the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..config import SamplingConfig, UserError
from ..pacing.budget import Budget

if TYPE_CHECKING:      # not imported at run time: the CLI reads the methods' options without transformers
    from ..acceptance import Verdict
    from ..cache import KVState
    from ..backends.torch_target import Target
    from ..tree import DraftTree

REGISTRY: dict[str, type["Proposer"]] = {}
FREE_READS = ("cpu",)      # device types whose tensors the host reads without waiting for the device


def register(cls: type["Proposer"]) -> type["Proposer"]:
    """Make a proposer class a method (by its `name`); a name taken by another class is refused."""
    taken = REGISTRY.get(cls.name)
    if taken is not None and taken is not cls:
        raise UserError(f"the method name '{cls.name}' is taken by {taken.__module__}.{taken.__qualname__}")
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
    # `pending` [B] long (== tokens[b][-1]) and `positions` [B] long (where the pending tokens go: the cache's
    # next positions), as given, or None: made when first read (a step that drafts nothing on a CPU backend reads
    # neither, and its first tensor operation would cost as much as the rest of its host work)
    _pending: torch.Tensor | None
    _positions: torch.Tensor | None
    cfg: SamplingConfig
    gens: list[torch.Generator] | None
    target: Target
    # how deep each row may draft and what a draft costs, from the engine's pacer (spekit.pacing.Budget): drafts
    # are sized with it (Budget.chain_widths, node_counts, cost, row_cost, margin) and with nothing else of pacing
    budget: Budget
    # the target's cache (committed tokens only). A proposer that drafts with the target's own layers may append
    # to it while it drafts, and must leave it exactly as it found it (spekit.backends.decoder_layers.Scratch does both).
    kv: KVState | None = None
    # per row: where its generated tokens begin in `tokens` (the prompt's length; frequency / presence penalties
    # count the generated tokens only). None: nothing generated is told apart (every token counts as generated)
    starts: list[int] | None = None
    # structured output (spekit.grammar): per row, the tokens its grammar forces after the pending token ([] where
    # none, or the row is not constrained); None when no row of the batch is constrained. Drafts like any other:
    # the target may prefer another tokenization of the forced text
    forced: list[list[int]] | None = None
    # the target verifies one chain per row (the llama.cpp backend's exact kernels): the engine keeps a tree's first
    # branch only and runs no side nodes, so tree drafters rank one chain
    chains_only: bool = False

    @property
    def pending(self) -> torch.Tensor:
        """[B] long: each row's pending token."""
        if self._pending is None:
            self._pending = torch.tensor([t[-1] for t in self.tokens], device=self.target.device)
        return self._pending

    @property
    def positions(self) -> torch.Tensor:
        """[B] long: the position each row's pending token will take."""
        if self._positions is None:
            self._positions = self.kv.next_positions()
        return self._positions

    @property
    def room(self) -> list[int]:
        """Per row: the deepest draft allowed (the budget's)."""
        return self.budget.room

    def generated_from(self) -> list[int]:
        return self.starts if self.starts is not None else [0] * len(self.tokens)


@dataclass(frozen=True)
class SideNodes:
    """Tokens a proposer runs in the same target forward as its draft tree without offering them for verification
    (lookahead decoding's Jacobi window). Each sees the committed cache, the tree's root (the pending token) and
    the side nodes `mask` allows; no tree node sees them. They leave the cache right after the forward; their
    logits reach `observe` after the tree's (declare needs_logits). A side node placed beyond the last position the
    context allows is padding."""

    tokens: torch.Tensor      # [B, M] long
    positions: torch.Tensor   # [B, M] long absolute positions; -1 marks padding
    mask: torch.Tensor        # [B, M, M] bool: side node i may attend side node j (each always sees itself)


class Proposer:
    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    needs_draft_model: ClassVar[bool] = False
    needs_hidden_states: ClassVar[bool] = False   # the target's hidden states are passed to begin / observe
    needs_logits: ClassVar[bool] = False          # the target's logits of the step are passed to observe
    needs_target_layers: ClassVar[bool] = False   # runs the target's own layers apart from its forward (self-drafting)
    lossless: bool = True                         # False where an option makes the method lossy (per instance)
    lossy_rule = None                             # an opt-in lossy acceptance rule (acceptance.TypicalAcceptance)
    speculates: ClassVar[bool] = True             # offers drafts (the engine then measures verification costs)
    paced_trees: ClassVar[bool] = False           # the pacer keeps its trees' rests and chances (ctx.budget.trees)
    help: ClassVar[str] = ""

    @classmethod
    def build(cls, target: Target, options, draft: Target | None = None, tokenizer=None) -> "Proposer":
        """The proposer for this target and draft (`tokenizer`: the target's, for drafters that read text; a draft
        target carries its own as `draft.tokenizer`)."""
        return cls(target, options, draft)

    def __init__(self, target: Target, options, draft: Target | None = None):
        if self.needs_draft_model and draft is None:
            raise UserError(f"method '{self.name}' needs a draft model (--draft NAME|PATH)")
        self.target, self.options, self.draft = target, options, draft

    def keeps_law(self, cfg: SamplingConfig) -> bool:
        """Whether its outputs under `cfg` are the target's own (plain's text greedy, its law sampled): not with a
        lossy option of its own, nor under cfg's relaxed rule when it drafts at all."""
        return self.lossless and (cfg.relaxed == 0 or not self.speculates)

    def hidden_layers(self) -> tuple[int, ...] | None:
        """Which of the target's hidden states `observe` reads (indices in Hugging Face's numbering: 0 the
        embeddings, i the output of layer i, num_layers after the final norm), for proposers that declare
        needs_hidden_states; None: all. Each step's forward keeps only these (the others are None in the tuple):
        keeping all 31 made a one-token float32 forward of the bundled model 0.7% dearer, one of them 0.04%."""
        return None

    def chain_pacing(self) -> tuple[int, int] | None:
        """For a chain drafter whose draft lengths the engine's pacer sizes per row (ctx.budget.widths, learnt from
        each row's acceptance and the drafting overhead): its starting length and its ceiling. None (default): the
        proposer sizes its drafts itself from the budget."""
        return None

    def unread(self, tokens: list[list[int]]) -> list[int] | None:
        """Per row, how many of its tokens (the committed text, `tokens`) this drafter must read before it can
        draft again: a draft model's catch-up after steps it did not draft, whose cost the pacer weighs against
        what drafting can still win (ChainPacer.widths). None (default): it reads nothing."""
        return None

    def draft_cost(self) -> float:
        """One draft forward relative to one target forward: what each drafted token costs beyond verification
        (the pacer weighs it with chain_pacing). Default: nothing."""
        return 0.0

    def begin(self, ctx: StepContext, hidden: tuple | None = None) -> None:
        """Called once after prefill, with the first generated token pending. hidden (when the proposer declares
        needs_hidden_states): the target's hidden states per layer, embeddings first, each [B, L, H] over the
        left-padded prompts."""

    def propose(self, ctx: StepContext) -> DraftTree | None:
        """A draft tree per row whose root is the pending token; None when no row drafts (a plain step, which the
        engine may then take without building trees: `Engine._plain_step`)."""
        raise NotImplementedError

    def side_nodes(self, ctx: StepContext) -> SideNodes | None:
        """Asked right after `propose`: side nodes to run in the same forward as the tree (default none)."""
        return None

    def observe(self, ctx: StepContext, verdict: Verdict, gained: list[list[int]],
                hidden: tuple | None = None, logits: torch.Tensor | None = None) -> None:
        """The verdict of the last step; `gained` holds each row's committed new tokens (accepted + next); hidden
        (when declared): the target's hidden states per layer at every tree node, each [B, N, H], to be gathered
        along verdict.path (then at the side nodes, [B, N+M, H], when there were any). logits (only when
        needs_logits is declared): the target's raw logits [B, N+M, V] at the N tree nodes, then the M side
        nodes."""

    def reads_plain_logits(self) -> bool:
        """Whether the coming `observe`, after a step where no row drafted, reads its logits (asked before such a
        step's logits are copied out of a CPU backend's buffer; when False, observe gets logits=None)."""
        return self.needs_logits

    def forget(self) -> None:
        """Drop what the proposer kept from earlier generations for later ones (a warm-up's text, so that the
        prompt it answered is not drafted from its own answer when it is asked again). Default: nothing kept."""

    def select_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep the state of these rows, in this order."""

    def add_rows(self, ctx: StepContext, hidden: tuple | None = None) -> None:
        """New rows join the running batch after its last row (continuous batching, `spekit.batching`): ctx and
        hidden describe the new rows only, as `begin` would see them. A proposer that keeps per-row state
        implements it; without it (this default) new rows wait until the running batch has drained."""
        raise NotImplementedError

    @classmethod
    def can_add_rows(cls) -> bool:
        return cls.add_rows is not Proposer.add_rows


def all_stopped(active: torch.Tensor) -> bool:
    """No row of active [B] drafts on; read only where free (FREE_READS): elsewhere a sync per token, so False."""
    return active.device.type in FREE_READS and not bool(active.any())


def get(name: str) -> type[Proposer]:
    if name not in REGISTRY:
        from .plugins import load_plugins
        load_plugins()                         # a method of an add-on (spekit.proposers.plugins)
    if name not in REGISTRY:
        raise UserError(f"unknown method '{name}'; available: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
