"""Bad input to train / export / check / medusa tree / head and datastore folders: one line on stderr and exit 2,
before any long work, and nothing lost or half-written on disk."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import UserError
from spekit.heads import HEADS, save_head
from spekit.backends.torch_models import load_model
from spekit.backends.torch_target import Target

from test_cli import _save_tiny

WORDS = ["the quick brown fox", "one two three four", "speculative decoding drafts", "the lazy dog jumps"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"), layers=2)


@pytest.fixture(scope="module")
def target(tiny):
    return Target(load_model(tiny).model, fast=False)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("\n".join(WORDS) + "\n")
    return str(path)


def _heads(target, folder, kind, meta=None, **options):
    return str(save_head(HEADS[kind].create(target, **options), folder, meta=meta or {}))


@pytest.fixture
def no_model(monkeypatch):
    """The command must fail before it loads a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(Spekit, "load", refuse)


def fails(capsys, argv, *words):
    """`spekit argv` exits 2 with one line on stderr that holds each of words."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spekit: error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_temp_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


# --- 1: --out never replaces what spekit did not write -------------------------------------------------------------

def test_export_out_refuses_what_it_must_not_replace(target, tmp_path, capsys):
    heads = Path(_heads(target, tmp_path / "heads", "eagle"))
    source = _snapshot(heads)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    other = _heads(target, tmp_path / "medusa", "medusa")
    export = ["export", "--to", "vllm", str(heads), "--out"]
    fails(capsys, [*export, str(proj)], str(proj), "other files")
    fails(capsys, [*export, str(tmp_path / "file")], "is a file")
    fails(capsys, [*export, str(tmp_path / "file" / "sub")], "is a file")
    fails(capsys, [*export, str(heads)], "the folder it is made from")
    fails(capsys, [*export, str(heads / "x")], "inside")
    fails(capsys, [*export, other], "'medusa' heads")
    assert (proj / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert _snapshot(heads) == source and not (heads / "x").exists()
    assert main([*export, str(tmp_path / "out")]) == 0
    assert main([*export, str(tmp_path / "out")]) == 0          # an earlier export is replaced
    assert main([*export, str(proj / "sub")]) == 0              # a new folder inside a user's folder is fine
    capsys.readouterr()
    _no_temp_left(tmp_path)


def test_a_failed_write_leaves_nothing_behind(target, tmp_path, capsys, monkeypatch):
    from spekit.heads import base
    heads = _heads(target, tmp_path / "heads", "eagle")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(base, "save_file", full)
    fails(capsys, ["export", "--to", "vllm", heads, "--out", str(tmp_path / "out")], "No space left")
    assert not (tmp_path / "out").exists()
    _no_temp_left(tmp_path)


def test_a_read_only_parent_is_refused_before_writing(target, tmp_path, capsys, monkeypatch):
    """A read-only parent, or a read-only folder inside it (simulated: root writes anywhere, and a run as another
    user cannot read a checkout in a private folder)."""
    heads = _heads(target, tmp_path / "heads", "eagle")
    top, ro = tmp_path / "top", tmp_path / "top" / "ro"
    ro.mkdir(parents=True)
    readonly = {top, ro}
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) not in readonly and real(path, mode))
    for out in (top / "new", ro / "sub"):
        fails(capsys, ["export", "--to", "vllm", heads, "--out", str(out)], f"cannot write in {out.parent}")
    assert sorted(p.name for p in top.iterdir()) == ["ro"] and not list(ro.iterdir())


def test_train_out_and_data_are_checked_before_the_work(target, tiny, prompts, tmp_path, capsys, no_model):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    medusa = _heads(target, tmp_path / "medusa", "medusa")
    train = ["--model", tiny, "--prompts", prompts]
    for kind in ("eagle", "medusa", "eagle3", "draft", "mtp", "rest"):
        fails(capsys, ["train", kind, *train, "--out", str(proj)], "other files")
        fails(capsys, ["train", kind, *train, "--out", str(tmp_path / "file" / "heads")], "is a file")
    fails(capsys, ["train", "eagle", *train, "--out", medusa], "'medusa' heads", "'eagle' heads")
    fails(capsys, ["train", "rest", *train, "--out", medusa], "'medusa' heads", "a datastore")
    fails(capsys, ["train", "eagle", *train, "--out", str(tmp_path / "e"), "--data", str(tmp_path / "file")],
          "--data", "is a file")
    fails(capsys, ["train", "eagle", *train, "--out", str(tmp_path / "e"), "--data", str(tmp_path / "e" / "d")],
          "--data", "inside --out")
    fails(capsys, ["train", "distill", "--model", tiny, "--prompts", prompts, "--out", str(tmp_path / "file" / "d")],
          "is a file")
    assert (proj / "notes.txt").read_text() == "mine" and not (tmp_path / "e").exists()
    _no_temp_left(tmp_path)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_train_refuses_a_place_where_no_file_can_be_made(tiny, prompts, capsys, no_model):
    """Root's os.access says yes to /proc; the distillation's minutes then ended in a traceback."""
    fails(capsys, ["train", "eagle", "--model", tiny, "--prompts", prompts, "--out", "/proc/spekit-x"],
          "cannot write in /proc")
    fails(capsys, ["train", "prompts", "--out", "/proc/spekit-x/p.jsonl", "--count", "2"], "cannot be written")


def test_train_init_is_checked_before_the_distillation(target, tiny, prompts, tmp_path, capsys, monkeypatch):
    """--init that is no head folder, holds another kind, or was trained for another model: refused before any
    answer is distilled, and no work folder is left."""
    import spekit.commands.train as train_cli

    def refuse(*args, **kwargs):
        raise AssertionError("answers were distilled before --init was checked")
    monkeypatch.setattr(train_cli, "distill_data", refuse)
    medusa = _heads(target, tmp_path / "medusa", "medusa")
    other = Target(load_model(_save_tiny(tmp_path / "other", layers=3)).model)
    alien = _heads(other, tmp_path / "alien", "eagle")
    capsys.readouterr()                                   # the saving's progress bars
    train = ["train", "eagle", "--model", tiny, "--prompts", prompts, "--out", str(tmp_path / "e"), "--steps", "1",
             "--held-out", "1"]
    fails(capsys, [*train, "--init", str(tmp_path / "nope")], "not a spekit head directory")
    fails(capsys, [*train, "--init", medusa], "'medusa' head, not 'eagle'")
    fails(capsys, [*train, "--init", alien], "trained for another model")
    assert not (tmp_path / "e").exists() and not (tmp_path / "e.work").exists()


# --- 2: Medusa heads export from the command line ------------------------------------------------------------------

def test_the_cli_exports_medusa_heads(target, tiny, prompts, tmp_path, capsys):
    from spekit.heads.export_medusa import read_vllm_medusa
    bare = _heads(target, tmp_path / "bare", "medusa", num_heads=2)
    fails(capsys, ["export", "--to", "vllm", bare, "--out", str(tmp_path / "o1")], "--model")
    assert main(["export", "--to", "vllm", bare, "--out", str(tmp_path / "o1"), "--model", tiny]) == 0
    assert read_vllm_medusa(tmp_path / "o1", target).config.num_heads == 2
    own = _heads(target, tmp_path / "own", "medusa", num_heads=2, share_lm_head=False)   # needs no model
    assert main(["export", "--to", "vllm", own, "--out", str(tmp_path / "o2"), "--model", "no-such-model"]) == 0
    trained = tmp_path / "trained"
    assert main(["train", "medusa", "--model", tiny, "--prompts", prompts, "--out", str(trained), "--steps", "1",
                 "--batch-tokens", "64", "--max-new-tokens", "8", "--held-out", "0", "--num-heads", "2"]) == 0
    assert main(["export", "--to", "vllm", str(trained), "--out", str(tmp_path / "o3")]) == 0
    config = json.loads((tmp_path / "o3" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 2


# --- 3: head and datastore configs that are not spekit's -----------------------------------------------------------

@pytest.mark.parametrize("case, words", [("list", "not a spekit head's config"), ("no_config", "no 'config' object"),
                                         ("bad_config", "does not fit"), ("not_utf8", "not UTF-8")])
def test_a_head_config_that_is_not_a_heads_is_a_user_error(target, tiny, prompts, tmp_path, capsys, case, words):
    heads = Path(_heads(target, tmp_path / "h", "medusa"))
    info = json.loads((heads / "config.json").read_text())
    content = {"list": b"[1, 2]", "no_config": json.dumps({**info, "config": None}).encode(), "not_utf8": b"\xff{",
               "bad_config": json.dumps({**info, "config": {"heads": 2}}).encode()}[case]
    (heads / "config.json").write_bytes(content)
    before = (heads / "config.json").read_bytes()
    for argv in (["export", "--to", "vllm", str(heads), "--out", str(tmp_path / "o"), "--model", tiny],
                 ["medusa", "tree", str(heads)],
                 ["check", "--model", tiny, "--method", "medusa", "--heads", str(heads), "--prompts", prompts],
                 ["generate", "--model", tiny, "--method", "medusa", "--heads", str(heads), "hi"]):
        fails(capsys, argv, str(heads / "config.json"), words)
    assert (heads / "config.json").read_bytes() == before and not (tmp_path / "o").exists()


def test_missing_weights_are_said_to_be_missing(target, tiny, tmp_path, capsys):
    heads = Path(_heads(target, tmp_path / "h", "medusa"))
    (heads / "model.safetensors").unlink()
    fails(capsys, ["generate", "--model", tiny, "--method", "medusa", "--heads", str(heads), "hi"], "is missing")
    from spekit.retrieval.datastore import write_datastore
    from spekit.heads import target_info
    store = write_datastore(tmp_path / "d", [[1, 2, 3]], target_info(target), {})
    (store / "model.safetensors").unlink()
    fails(capsys, ["generate", "--model", tiny, "--method", "rest", "--datastore", str(store), "hi"], "is missing")


@pytest.mark.parametrize("content, words", [("[1]", "not a spekit datastore's config"),
                                            ('{"kind": "datastore", "target": [1]}', "no 'target' object")])
def test_a_datastore_config_that_is_not_a_datastores_is_a_user_error(target, tiny, tmp_path, capsys, content, words):
    from spekit.retrieval.datastore import write_datastore
    from spekit.heads import target_info
    store = write_datastore(tmp_path / "d", [[1, 2, 3]], target_info(target), {})
    (store / "config.json").write_text(content)
    fails(capsys, ["generate", "--model", tiny, "--method", "rest", "--datastore", str(store), "hi"],
          str(store / "config.json"), words)


# --- 4: medusa tree ------------------------------------------------------------------------------------------------

def test_medusa_tree_bounds_nodes_and_never_leaves_a_temp_file(target, tmp_path, capsys, monkeypatch):
    heads = Path(_heads(target, tmp_path / "h", "medusa", num_heads=2))
    before = (heads / "config.json").read_bytes()
    for nodes in ("0", "100000"):
        fails(capsys, ["medusa", "tree", str(heads), "--nodes", nodes], "--nodes must be in 1..")
    (heads / "config.json").write_text(json.dumps({**json.loads(before), "meta": {"accuracy": [[0.5]]}}))
    fails(capsys, ["medusa", "tree", str(heads)], "meta.accuracy")
    (heads / "config.json").write_bytes(before)

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", read_only)
        fails(capsys, ["medusa", "tree", str(heads), "--nodes", "8"], "cannot rewrite")
    assert (heads / "config.json").read_bytes() == before and sorted(p.name for p in heads.iterdir()) == [
        "config.json", "model.safetensors"]
    assert main(["medusa", "tree", str(heads), "--nodes", "8"]) == 0
    assert len(json.loads((heads / "config.json").read_text())["meta"]["tree"]) == 8


# --- 5: typical acceptance options need --acceptance typical -------------------------------------------------------

def test_typical_options_need_the_typical_acceptance(target, tiny, tmp_path, capsys):
    from spekit import proposers
    options = proposers.get("medusa").Options
    with pytest.raises(UserError, match="--acceptance typical"):
        options(typical_epsilon=0.5)
    with pytest.raises(UserError, match="--typical-delta"):
        options(typical_delta=0.5)
    options(acceptance="typical", typical_epsilon=0.5)
    heads = _heads(target, tmp_path / "h", "medusa")
    fails(capsys, ["generate", "--model", tiny, "--method", "medusa", "--heads", heads, "--typical-epsilon", "0.5",
                   "hi"], "--acceptance typical")


# --- 6: train numbers and files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, flags, words", [
    ("distill", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("distill", ["--limit", "0"], "--limit must be >= 1"),
    ("distill", ["--limit", "-1"], "--limit must be >= 1"),
    ("distill", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("eagle", ["--lr", "nan"], "--lr"),
    ("eagle", ["--lr", "inf"], "--lr"),
    ("eagle", ["--clip", "-1"], "--clip"),
    ("eagle", ["--weight-decay", "-1"], "--weight-decay"),
    ("eagle", ["--warmup", "-1"], "--warmup"),
    ("eagle", ["--feature-noise", "-1"], "--feature-noise"),
    ("eagle", ["--token-weight", "nan"], "--token-weight"),
    ("eagle3", ["--ttt-steps", "0"], "--ttt-steps"),
    ("medusa", ["--head-decay", "-1"], "--head-decay"),
    ("draft", ["--ce-weight", "-1"], "--ce-weight"),
    ("eagle", ["--eval-tokens", "0"], "--eval-tokens"),
    ("eagle", ["--max-len", "1"], "--max-len"),
    ("rest", ["--limit", "-1"], "--limit"),
])
def test_train_numbers_are_checked_before_the_work(tiny, prompts, tmp_path, capsys, no_model, kind, flags, words):
    fails(capsys, ["train", kind, "--model", tiny, "--prompts", prompts, "--out", str(tmp_path / "o"), *flags],
          words)
    assert not (tmp_path / "o").exists()


def test_train_files_that_are_not_text_or_not_folders(tiny, prompts, tmp_path, capsys, no_model):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9\n")
    out = ["--out", str(tmp_path / "o")]
    fails(capsys, ["train", "distill", "--model", tiny, "--prompts", str(bad), *out], "prompt file", "not UTF-8")
    fails(capsys, ["train", "eagle", "--model", tiny, "--prompts", str(tmp_path), *out], "is a folder")
    fails(capsys, ["train", "rest", "--model", tiny, "--texts", str(bad), *out], "texts file", "not UTF-8")
    fails(capsys, ["train", "rest", "--model", tiny, "--more-data", str(bad), *out], "--more-data", "is a file")
    answers = tmp_path / "answers"
    answers.mkdir()
    (answers / "answers.jsonl").write_bytes(b"\xff\n")
    fails(capsys, ["train", "rest", "--model", tiny, "--more-data", str(answers), *out], "not UTF-8")
    assert not (tmp_path / "o").exists()


# --- 7: check ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["folder", "limit", "turns_number", "turns_string"])
def test_check_input(target, tiny, tmp_path, capsys, no_model, case):
    heads = _heads(target, tmp_path / "h", "medusa")
    prompts, extra, words = tmp_path / "p.jsonl", [], ()
    prompts.write_text('{"turns": ["hello"]}\n')
    if case == "folder":
        prompts, words = tmp_path, ("is a folder",)
    elif case == "limit":
        extra, words = ["--limit", "-1"], ("--limit",)
    else:
        prompts.write_text('{"turns": 5}\n' if case == "turns_number" else '{"turns": "abc"}\n')
        words = (f"{prompts}:1", "'turns' must be a list of strings")
    fails(capsys, ["check", "--model", tiny, "--method", "medusa", "--heads", heads, "--prompts", str(prompts),
                   *extra], *words)
