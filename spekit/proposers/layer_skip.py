"""Self-speculative layer skipping (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024): draft with the
target minus a set of skipped layers, the set found by a training-free search on the user's prompts
(`spekit layer-skip search`, `spekit.heads.skip_set`) and read from the skip file (`--skip-file`). Drafting, draft
lengths and back-off are those of `early-exit` (`SelfDraft`): the kept layers run on the target's own cache."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import UserError
from .base import register
from .draft_model import check_lengths
from .early_exit import SelfDraft


@dataclass(frozen=True)
class LayerSkipOptions:
    skip_file: str = ""            # skip file written by `spekit layer-skip search` for this model
    num_draft_tokens: int = 4      # starting draft length per row
    max_draft_tokens: int = 8      # adaptive ceiling
    confidence: float = 0.3        # greedy: stop a row's draft when the draft's top probability is lower

    def __post_init__(self) -> None:
        check_lengths(self)


@register
class LayerSkip(SelfDraft):
    name = "layer-skip"
    Options = LayerSkipOptions
    help = "self-speculative: draft with the target minus the layers a search skipped (--skip-file)"

    def choose_layers(self) -> list[int]:
        from ..heads.skip_set import load
        if not self.options.skip_file:
            raise UserError("layer-skip needs --skip-file FILE (make one with: spekit layer-skip search --model M "
                            "--prompts FILE --out FILE)")
        skipped, first = load(self.options.skip_file, self.target)
        if first is not None:       # start from the acceptance the search measured on the user's prompts
            self.prior = (3 * first, 3 * (1.0 - first))
        return [i for i in range(self.target.num_layers) if i not in set(skipped)]
