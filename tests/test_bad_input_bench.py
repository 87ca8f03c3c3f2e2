"""User mistakes in `spekit bench`, `layer-skip search`, `advise`, `engine-config` and `serve`: a one-line error
and exit 2, found before any model loads or any long run starts, with nothing left on disk."""
from __future__ import annotations

import json
import os
import socket

import pytest

from spekit.cli import main
from test_cli import _save_tiny

QUESTION = {"question_id": 1, "category": "qa", "turns": ["the lazy dog the lazy dog"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n")
    return str(path)


@pytest.fixture()
def no_model(monkeypatch):
    """Loading a model fails the test: the mistake must be found before."""
    import spekit.api
    import spekit.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was found")
    monkeypatch.setattr(spekit.models, "load_model", refuse)
    monkeypatch.setattr(spekit.api.Spekit, "load", refuse)


def _refused(args: list[str], capsys, words: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


# --- layer-skip search --------------------------------------------------------------------------------------------

@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("the quick brown fox\n")
    return str(path)


def test_layer_skip_refuses_a_folder_as_out_before_the_search_and_leaves_nothing(tmp_path, prompts, capsys,
                                                                                  no_model):
    folder = tmp_path / "out"
    folder.mkdir()
    _refused(["layer-skip", "search", "--prompts", prompts, "--out", str(folder)], capsys, "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "p.txt"] and not list(folder.iterdir())


@pytest.mark.parametrize("args, words", [
    (["--trials", "-5"], "--trials must be >= 0"),
    (["--out", "FILE/below/s.json"], "is a file, not a folder"),
])
def test_layer_skip_bad_flags(tmp_path, prompts, capsys, no_model, args, words):
    args = [a.replace("FILE", prompts) for a in args]
    _refused(["layer-skip", "search", "--prompts", prompts, "--out", str(tmp_path / "s.json"), *args], capsys, words)
    assert not (tmp_path / "s.json").exists()


def test_layer_skip_reads_jsonl_records_and_writes_the_skip_file_in_its_own_folder(tiny, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "the quick brown fox jumps"}\n{"turns": ["one two three one two"]}\n')
    out = tmp_path / "skips" / "s.json"
    assert main(["layer-skip", "search", "--model", tiny, "--prompts", str(path), "--out", str(out), "--raw",
                 "--max-new-tokens", "6", "--depth", "2", "--per-prompt", "2", "--trials", "1"]) == 0
    assert json.loads(out.read_text())["prompts"] == 2
    assert [p.name for p in out.parent.iterdir()] == ["s.json"]
    capsys.readouterr()
    path.write_text('{"prompt": "fine"}\n[1, 2]\n')
    _refused(["layer-skip", "search", "--prompts", str(path), "--out", str(out)], capsys, "p.jsonl:2: each line")


# --- advise and the prompt files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", ["nan", "inf", "-1", "0"])
def test_advise_refuses_a_budget_that_is_not_a_finite_positive_number(prompts, capsys, no_model, budget):
    _refused(["advise", "--prompts", prompts, "--budget-s", budget], capsys, "--budget-s must be a finite number")


@pytest.mark.parametrize("line", ["[1, 2]", '"text"', '{"turns": [3]}', '{"turns": []}', "{"])
def test_a_jsonl_prompt_line_that_is_not_a_record_is_refused(tmp_path, capsys, no_model, line):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    _refused(["generate", "--prompts-file", str(path)], capsys, "p.jsonl:2: each line must be a JSON object")
    _refused(["advise", "--prompts", str(path)], capsys, "p.jsonl:2: each line must be a JSON object")


def test_a_prompt_folder_says_it_is_a_folder(tmp_path, capsys, no_model):
    _refused(["advise", "--prompts", str(tmp_path)], capsys, "is a folder")
    _refused(["generate", "--prompts-file", str(tmp_path)], capsys, "is a folder")
