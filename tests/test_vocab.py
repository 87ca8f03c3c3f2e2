"""A reduced draft vocabulary (spekit.backends.draft_vocab): the head computes only the chosen rows, returns full-size logits with
-inf elsewhere, and refuses ids that do not fit the model."""
from __future__ import annotations

import pytest
import torch

from spekit.config import UserError
from spekit.backends.draft_vocab import ReducedHead, most_frequent, reduce_head

from conftest import tiny_llama


def test_reduced_head_equals_the_full_head_on_its_rows_and_minus_inf_elsewhere():
    full = torch.nn.Linear(16, 10, bias=True)
    ids = torch.tensor([1, 4, 7])
    head = ReducedHead(full.weight.detach(), ids, full.bias.detach())
    x = torch.randn(2, 3, 16)
    out = head(x)                                                              # [2, 3, 10]
    assert out.shape == (2, 3, 10) and head.out_features == 10
    assert torch.allclose(out[..., ids], full(x)[..., ids], atol=1e-6)
    rest = torch.ones(10, dtype=torch.bool)
    rest[ids] = False
    assert torch.isinf(out[..., rest]).all() and (out[..., rest] < 0).all()


def test_most_frequent_takes_the_counted_tokens_then_the_lowest_ids():
    counts = torch.zeros(10)
    counts[[9, 7, 3]] = torch.tensor([5.0, 2.0, 1.0])
    assert most_frequent(counts, 2).tolist() == [7, 9]
    assert most_frequent(counts, 5).tolist() == [0, 1, 3, 7, 9]
    assert most_frequent(counts, 99).tolist() == list(range(10))
    with pytest.raises(UserError, match="at least 1"):
        most_frequent(counts, 0)


@pytest.mark.parametrize("ids", [[], [0, 0, 1], [-1, 2], [3, 1000]])
def test_bad_draft_vocabularies_are_user_errors(ids):
    with pytest.raises(UserError, match="distinct token ids"):
        reduce_head(tiny_llama(seed=0, layers=1), ids)


def test_a_reduced_model_keeps_its_vocabulary_size_for_every_caller():
    model = tiny_llama(seed=0, layers=1)
    vocab = model.config.vocab_size
    reduce_head(model, [0, 5, 9])
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == vocab == model.get_output_embeddings().out_features
    assert set(logits[0, -1].isfinite().nonzero().flatten().tolist()) == {0, 5, 9}
