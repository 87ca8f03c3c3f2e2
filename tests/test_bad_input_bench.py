"""User mistakes in `spekit bench`, `layer-skip search`, `advise`, `engine-config` and `serve`: a one-line error
and exit 2, found before any model loads or any long run starts, with nothing left on disk."""
from __future__ import annotations

import json
import os
import socket

import pytest

from spekit.commands import main
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
    import spekit.backends.torch_models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was found")
    monkeypatch.setattr(spekit.backends.torch_models, "load_model", refuse)
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
    data = json.loads(out.read_text())
    assert data["prompts"] == 2
    assert [p.name for p in out.parent.iterdir()] == ["s.json"]
    said = capsys.readouterr()
    assert ("no set of skipped layers pays" in said.out) == (data["skip"] == [])   # said plainly, not "skip 0"
    assert "first draft token accepted" in said.err
    path.write_text('{"prompt": "fine"}\n[1, 2]\n')
    _refused(["layer-skip", "search", "--prompts", str(path), "--out", str(out)], capsys, "p.jsonl:2: each line")


# --- bench --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--methods", "plain", "--method", "foo"], "not both"),
    (["--methods", ""], "has an empty name"),
    (["--methods", "plain,"], "has an empty name"),
    (["--method", "foo"], "unknown method or peer foo"),
    (["--methods", "plain", "--hf-early-exit-layer", "1"], "is for the hf-early-exit peer"),
    (["--sweep-limit", "0"], "--sweep-limit must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--methods", "ngram", "--sweep", "num_draft_tokens=0,2", "--report", "R"], "num_draft_tokens=0: num_draft"),
    (["--methods", "plain", "--sweep", "temperature=-1", "--report", "R"], "temperature=-1.0: temperature"),
    (["--out", "."], "--out . is a folder"),
    (["--out", "Q/x.json"], "is a file, not a folder"),
    (["--report", "Q"], "--report"),
    (["--answers", "Q/a"], "is a file, not a folder"),
])
def test_bench_refuses_before_loading_a_model(tiny, questions, capsys, no_model, args, words):
    args = [a.replace("Q", questions) for a in args]
    _refused(["bench", "--model", tiny, "--questions", questions, "--raw", *args], capsys, words)


def test_bench_refuses_a_bad_sweep_before_the_base_run_and_writes_nothing(tiny, questions, tmp_path, capsys,
                                                                          no_model):
    report = tmp_path / "R"
    _refused(["bench", "--model", tiny, "--questions", questions, "--methods", "plain", "--sweep", "batch=0,1",
              "--report", str(report)], capsys, "bad sweep value batch=0")
    assert not report.exists()


def test_bench_refuses_an_output_folder_it_cannot_write(tiny, questions, tmp_path, capsys, no_model, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    for flag, target in (("--out", locked / "r.json"), ("--report", locked / "R"), ("--answers", locked)):
        _refused(["bench", "--model", tiny, "--questions", questions, flag, str(target)], capsys,
                 f"no write permission in {locked}")
    assert not list(locked.iterdir())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_bench_refuses_a_place_where_no_file_can_be_made(tiny, questions, capsys, no_model):
    """/proc says yes to root's os.access, and the run then failed after its minutes: the place is tried."""
    for flag, target in (("--out", "/proc/spekit-x/r.json"), ("--report", "/proc/spekit-x"),
                         ("--answers", "/proc/spekit-x/a")):
        _refused(["bench", "--model", tiny, "--questions", questions, flag, target], capsys, "cannot be written")


def test_bench_refuses_a_method_option_no_method_run_takes(tiny, questions, capsys, no_model):
    _refused(["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram", "--depth", "3"],
             capsys, "no method run here takes --depth")


def test_bench_refuses_a_question_file_that_is_not_utf8(tiny, tmp_path, capsys, no_model):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    _refused(["bench", "--model", tiny, "--questions", str(path)], capsys, "is not UTF-8 text")


def test_bench_refuses_an_early_exit_layer_the_model_lacks_before_any_answer(tiny, questions, tmp_path, capsys):
    answers = tmp_path / "answers"
    _refused(["bench", "--model", tiny, "--questions", questions, "--methods", "hf-early-exit",
              "--hf-early-exit-layer", "99", "--answers", str(answers), "--raw"], capsys, "in [1, 1] for this model")
    assert not answers.exists()


def test_bench_method_alone_is_that_method_against_plain(tiny, questions, capsys):
    assert main(["bench", "--model", tiny, "--questions", questions, "--method", "ngram", "--max-new-tokens", "4",
                 "--raw"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["results"]) == {"plain", "ngram"}


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


# --- engine-config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--method", "ngram", "--heads", "X", "--draft", "Y"], "--draft is for --method draft"),
    (["--method", "ngram", "--heads", "X"], "--heads is for --method eagle, eagle3, medusa"),
    (["--method", "plain", "--draft", "Y"], "--draft is for --method draft"),
    (["--method", "eagle3", "--heads", "/nonexistent"], "--heads /nonexistent not found"),
])
def test_engine_config_refuses_flags_the_method_does_not_use_and_missing_heads(capsys, args, words):
    _refused(["engine-config", "--engine", "vllm", *args], capsys, words)


def test_engine_config_says_to_export_a_spekit_head_folder(tmp_path, capsys):
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"kind": "eagle3", "config": {}, "target": {}}))
    _refused(["engine-config", "--engine", "sglang", "--method", "eagle3", "--heads", str(heads)], capsys,
             f"run `spekit export {heads} --to sglang --out EXPORTED`")
    (heads / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   "spekit": {"kind": "eagle3"}}))
    assert main(["engine-config", "--engine", "sglang", "--method", "eagle3", "--heads", str(heads)]) == 0
    assert str(heads) in capsys.readouterr().out


def test_engine_config_refuses_heads_an_engine_cannot_load(tmp_path, capsys):
    """A folder with no model config, a config that is not JSON, another method's export, or a file (but a .gguf
    for llama.cpp): one line naming the problem, before any command is printed."""
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(["engine-config", "--engine", "vllm", "--method", "eagle3", "--heads", str(empty)], capsys,
             "holds no config.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    _refused(["engine-config", "--engine", "vllm", "--method", "eagle3", "--heads", str(broken)], capsys,
             "config.json is not JSON")
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"architectures": ["MedusaModel"], "spekit": {"kind": "medusa"}}))
    _refused(["engine-config", "--engine", "vllm", "--method", "eagle3", "--heads", str(medusa)], capsys,
             "holds exported 'medusa' heads, not 'eagle3' heads")
    gguf = tmp_path / "eagle3.gguf"
    gguf.write_bytes(b"GGUF")
    _refused(["engine-config", "--engine", "vllm", "--method", "eagle3", "--heads", str(gguf)], capsys, "is a file")
    assert main(["engine-config", "--engine", "llamacpp", "--method", "eagle3", "--heads", str(gguf)]) == 0
    assert str(gguf) in capsys.readouterr().out


# --- serve --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("port", ["99999", "-1"])
def test_serve_refuses_a_port_out_of_range(capsys, no_model, port):
    _refused(["serve", "--port", port], capsys, f"--port must be in 0..65535, got {port}")


def test_serve_refuses_a_port_in_use_and_an_unknown_host(capsys, no_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _refused(["serve", "--port", str(port)], capsys, f"cannot serve on 127.0.0.1:{port}")
    _refused(["serve", "--host", "no.such.host.invalid", "--allow-no-api-key"], capsys, "unknown host")
