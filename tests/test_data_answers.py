"""Training on a conversation file's own answers (`--keep-answers`, EAGLE's recipe on ShareGPT): the assistant
messages are read beside the user turns, become answered turns without generation, ended as the chat template
ends an assistant message; turns the data leaves unanswered (and the ones after them) are the target's."""
from __future__ import annotations

import json

import pytest

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig
from spekit.train.distill import Distiller, read_answers
from spekit.train.prompt_files import read_prompts

from test_cli import _save_tiny, _with_template

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
RECORDS = [
    {"id": "a", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "the quick"},
                                  {"from": "gpt", "value": "brown fox jumps"}, {"from": "human", "value": "and?"},
                                  {"from": "gpt", "value": "over the lazy dog"}]},
    {"id": "b", "messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"},
                             {"role": "user", "content": "five"}]},
    {"id": "c", "messages": [{"role": "user", "content": "speculative"}]},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return _with_template(_save_tiny(tmp_path_factory.mktemp("tiny")), TEMPLATE)


@pytest.fixture
def convo_file(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_conversations_keep_their_answers_beside_the_turns(convo_file):
    a, b, c = read_prompts(convo_file)
    assert a == {"id": "a", "turns": ["the quick", "and?"], "answers": ["brown fox jumps", "over the lazy dog"]}
    assert b == {"id": "b", "turns": ["one two", "five"], "answers": ["three four", None]}
    assert c == {"id": "c", "turns": ["speculative"]}                  # nothing answered: no "answers"


def test_kept_answers_are_the_datas_and_the_rest_the_targets(chat_model, convo_file, tmp_path):
    sk = Spekit.load(chat_model)
    records = read_prompts(convo_file)
    out = tmp_path / "kept"
    assert Distiller(sk, out, max_new_tokens=6, batch_size=4, keep_answers=True).run(records, progress=False) == 5
    got = {r["id"]: r for r in read_answers(out)}
    eos = sk.tokenizer.eos_token_id
    for rid, text in (("a", "brown fox jumps"), ("a/t2", "over the lazy dog"), ("b", "three four")):
        assert got[rid]["finish"] == "data"
        assert got[rid]["answer_ids"][-1] == eos                      # ended as the template ends the message
        assert sk.decode(got[rid]["answer_ids"][:-1]) == text
        whole = got[rid]["prompt_ids"] + got[rid]["answer_ids"]       # the context the features are taken along
        assert sk.tokenizer.decode(whole).endswith(f"<assistant>{text}<eos>")
    assert "three four" in sk.decode(got["b/t2"]["prompt_ids"])         # the target answers after the data's answer
    for rid in ("b/t2", "c"):
        assert got[rid]["finish"] in ("stop", "length")
        plain = sk.engine.generate([got[rid]["prompt_ids"]], SamplingConfig(max_new_tokens=6))[0]
        assert got[rid]["answer_ids"] == plain.token_ids
    assert Distiller(sk, out, max_new_tokens=6, keep_answers=True).run(records, progress=False) == 0   # resumes


def test_without_the_flag_the_target_answers_everything(chat_model, convo_file, tmp_path, capsys):
    assert main(["train", "distill", "--model", chat_model, "--prompts", str(convo_file), "--out",
                 str(tmp_path / "own"), "--max-new-tokens", "4"]) in (0, None)
    assert all(r["finish"] != "data" for r in read_answers(tmp_path / "own"))
    assert main(["train", "distill", "--model", chat_model, "--prompts", str(convo_file), "--out",
                 str(tmp_path / "kept"), "--max-new-tokens", "4", "--keep-answers"]) in (0, None)
    assert sum(r["finish"] == "data" for r in read_answers(tmp_path / "kept")) == 3


def test_keep_answers_on_a_file_without_answers_is_refused_before_loading(tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_text("one prompt\nanother\n")
    assert main(["train", "distill", "--model", str(tmp_path / "no-model"), "--prompts", str(path), "--out",
                 str(tmp_path / "d"), "--keep-answers"]) == 2
    assert "holds no answers to keep" in capsys.readouterr().err
    assert not (tmp_path / "d" / "answers.jsonl").exists()
