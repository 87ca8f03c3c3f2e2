"""Methods from outside spekit (spekit.proposers.plugins): a file named in SPEKIT_PLUGINS becomes a method of every command,
lossless through the core like the shipped ones; an installed plugin that fails is skipped with a warning; a named
one that fails, or a method name already taken, is a one-line error."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from spekit.proposers import plugins
from spekit.commands import main
from spekit.config import UserError
from spekit.proposers import REGISTRY, Proposer, register
from test_cli import _save_tiny

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "bigram_method.py")
PROMPT = "one two three one two three one two three one two"


@pytest.fixture
def fresh(monkeypatch):
    """Plugins load anew, and what they registered is gone afterwards."""
    before = dict(REGISTRY)
    monkeypatch.setattr(plugins, "_done", False)
    yield monkeypatch
    for name in set(REGISTRY) - set(before):
        del REGISTRY[name]
    sys.modules.pop("spekit_plugin_bigram_method", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("plug"))


def _answer(tiny, capsys, *flags) -> dict:
    assert main(["generate", "--model", tiny, "--raw", "--json", "--max-new-tokens", "24", "--cost-profile", "none",
                 *flags, PROMPT]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_a_plugin_file_is_a_method_with_its_options(fresh, tiny, capsys):
    fresh.setenv(plugins.ENV, EXAMPLE)
    got = _answer(tiny, capsys, "--method", "bigram", "--max-draft", "3")
    assert "bigram" in REGISTRY and got["method"] == "bigram"
    assert got["token_ids"] == _answer(tiny, capsys)["token_ids"]         # plain's answer: the core verified it
    assert got["target_forwards"] < got["new_tokens"], "the bigram drafts were accepted"
    assert main(["generate", "--model", tiny, "--method", "bigram", "--max-draft", "0", "hi"]) == 2
    assert "max_draft must be >= 1" in capsys.readouterr().err


def test_plugin_failures(fresh, tiny, capsys):
    class Broken:
        name, value = "broken", "nowhere.module"

        def load(self):
            raise ImportError("no module named nowhere")

    fresh.setattr(plugins, "entry_points", lambda group: [Broken()])
    with pytest.warns(UserWarning, match="'broken' .* did not load and is skipped"):
        plugins.load_plugins()                                # an installed add-on: skipped, spekit goes on
    fresh.setattr(plugins, "entry_points", lambda group: [])
    for named, words in [("no_such_module_here", "did not load: ModuleNotFoundError"),
                         ("missing.py", "which is not a file")]:
        fresh.setattr(plugins, "_done", False)
        fresh.setenv(plugins.ENV, named)
        assert main(["generate", "--model", tiny, "hi"]) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(UserError, match="'ngram' is taken by spekit.proposers.ngram.Ngram"):
        register(type("MyNgram", (Proposer,), {"name": "ngram"}))
