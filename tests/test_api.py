"""The Python API over models the caller loaded itself (`Spekit.from_model`): the same tokens as the engine over the
same weights, with or without a draft model, and the same UserErrors as the CLI's paths."""
from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from spekit.api import Spekit
from spekit.config import SamplingConfig, UserError
from test_cli import _save_tiny


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("api")), _save_tiny(tmp_path_factory.mktemp("api-draft"), layers=1,
                                                                   seed=1)


def test_from_model_equals_load(folders):
    target, draft = folders
    cfg = SamplingConfig(max_new_tokens=12)
    want = Spekit.load(target).generate(["the quick brown fox"], cfg, chat=False)[0]
    model, tok = AutoModelForCausalLM.from_pretrained(target), AutoTokenizer.from_pretrained(target)
    for method, draft_model in [("plain", None), ("ngram", None), ("draft", AutoModelForCausalLM.from_pretrained(draft))]:
        sk = Spekit.from_model(model, tok, method, draft_model, cost_profile="none")
        got = sk.generate(["the quick brown fox"], cfg, chat=False)[0]
        assert got.result.token_ids == want.result.token_ids and got.text == want.text, method


def test_from_model_errors(folders):
    model, tok = AutoModelForCausalLM.from_pretrained(folders[0]), AutoTokenizer.from_pretrained(folders[0])
    with pytest.raises(UserError, match="unknown method"):
        Spekit.from_model(model, tok, "nope")
    with pytest.raises(UserError, match="does not take"):
        Spekit.from_model(model, tok, "plain", ngram_max=3)
    with pytest.raises(UserError, match="does not use a draft model"):
        Spekit.from_model(model, tok, "ngram", model)
