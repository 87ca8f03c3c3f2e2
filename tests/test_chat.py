"""`spekit chat`: each turn's answer is the one the whole conversation gets from the engine (greedy, any method),
/reset starts again, and misuse is a one-line error."""
from __future__ import annotations

import io

import pytest

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig
from test_cli import _save_tiny, _with_template

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _with_template(_save_tiny(tmp_path_factory.mktemp("chat")), TEMPLATE)


def _chat(model: str, lines: str, capsys, monkeypatch, *flags) -> tuple[int, list[str], str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["chat", "--model", model, "--max-new-tokens", "12", "--cost-profile", "none", *flags])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_turns_answer_the_whole_conversation(model, capsys, monkeypatch):
    code, answers, err = _chat(model, "the quick brown fox\none two three\n\n/reset\none two three\n/exit\nnever\n",
                               capsys, monkeypatch, "--method", "ngram", "--system", "be brief")
    assert code == 0 and len(answers) == 3 and err.count("tau") == 3 and "a new conversation" in err
    sk = Spekit.load(model, cost_profile="none")
    cfg = SamplingConfig(max_new_tokens=12)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    want = [sk.engine.generate([sk.encode(first)], cfg)[0]]
    second = first + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "one two three"}]
    want.append(sk.engine.generate([sk.encode(second)], cfg)[0])
    alone = [first[0], {"role": "user", "content": "one two three"}]
    want.append(sk.engine.generate([sk.encode(alone)], cfg)[0])
    assert answers == [sk.decode(r.token_ids) for r in want]
    assert answers[1] != answers[2], "the history changed the second answer"


def test_misuse_is_a_one_line_error(model, tmp_path, capsys, monkeypatch):
    code, _, err = _chat(model, "hi\n", capsys, monkeypatch, "--n", "2")
    assert code == 2 and "one answer a turn" in err
    raw = _save_tiny(tmp_path / "raw")
    code, _, err = _chat(raw, "hi\n", capsys, monkeypatch)
    assert code == 2 and "no chat template" in err
    code, answers, err = _chat(model, "fox " * 300 + "\nthe quick\n", capsys, monkeypatch)
    assert code == 0 and "context" in err and len(answers) == 1      # the session goes on after the long line
    for flags, words in ((["--regex", "(["], "regex cannot be used"), (["--stop-ids", "99999"], "stop id 99999"),
                         (["--json-schema", '{"type": "nonsense"}'], "json_schema cannot be used")):
        code, answers, err = _chat(model, "hi\nho\n", capsys, monkeypatch, *flags)   # refused once, before turns
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and not answers, err
    with pytest.raises(SystemExit):
        _chat(model, "hi\n", capsys, monkeypatch, "--stop", "")
    assert "must not be empty" in capsys.readouterr().err


def test_a_chat_template_given_on_the_command_line(tmp_path, capsys, monkeypatch):
    """--chat-template gives a model without one a template (chat, generate, serve take it), and one that does not
    render is a one-line error."""
    raw = _save_tiny(tmp_path / "raw")
    code, _, err = _chat(raw, "hi\n", capsys, monkeypatch, "--chat-template", TEMPLATE)
    assert code == 0 and "tau" in err
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert main(["generate", "--model", raw, "--chat", "--chat-template", f"@{path}", "--max-new-tokens", "4",
                 "hi"]) == 0
    capsys.readouterr()
    code, _, err = _chat(raw, "hi\n", capsys, monkeypatch, "--chat-template", "{% for m in messages %}")
    assert code == 2 and "--chat-template does not render a conversation" in err
