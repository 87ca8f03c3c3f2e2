"""`--method auto`: the method the selection table picks from the drafters this model has here, said on stderr,
recorded as that method, and as lossless as it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spekit import methods
from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig, UserError
from tests.test_cli import _save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"))


def test_a_model_with_no_drafters_gets_retrieval_from_its_context(tiny, capsys):
    assert main(["generate", "--model", tiny, "--method", "auto", "--max-new-tokens", "16", "--json", "--raw",
                 "one two three four one two three"]) == 0
    out = capsys.readouterr()
    assert "[spekit] --method auto: rest (no drafter ships for this model" in out.err
    auto = json.loads(out.out.splitlines()[-1])
    assert auto["method"] == "rest"
    assert main(["generate", "--model", tiny, "--max-new-tokens", "16", "--json", "--raw",
                 "one two three four one two three"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"] == auto["token_ids"]


@pytest.mark.parametrize("ships, method", [({"rest", "eagle3"}, "rest"), ({"eagle3"}, "eagle3-lookup"),
                                           (set(), "rest")])
def test_the_choice_follows_what_ships(tiny, monkeypatch, ships, method):
    from spekit.heads import base
    monkeypatch.setattr(base, "shipped_dir", lambda kind, target, accept=None: Path(kind) if kind in ships else None)
    sk = Spekit.load(tiny, "plain")
    assert methods.auto_method(sk.target)[0] == method


def test_the_api_takes_auto_and_with_method_too(tiny):
    sk = Spekit.load(tiny, "auto")
    assert sk.method == "rest" and sk.auto_reason
    again = sk.with_method("auto")
    assert again.method == "rest"
    cfg = SamplingConfig(max_new_tokens=12)
    assert [g.result.token_ids for g in again.generate(["the quick brown fox"], cfg)] == \
        [g.result.token_ids for g in sk.with_method("plain").generate(["the quick brown fox"], cfg)]
    assert Spekit.load(tiny, "plain").auto_reason is None


def test_an_unknown_method_is_still_an_error_before_loading():
    with pytest.raises(UserError, match="unknown method 'automatic'"):
        Spekit.load("./no/such/model", "automatic")
