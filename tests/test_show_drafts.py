"""--show-drafts: which text came from accepted drafts. The marks follow the engine's own count of each step's
accepted tokens, streamed and finished alike, and colouring changes nothing else of the output."""
from __future__ import annotations

import io
import json
import re

import pytest

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig
from spekit.detokenize import drafted_flags, marked_text
from test_chat import TEMPLATE
from test_cli import _save_tiny, _with_template

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _with_template(_save_tiny(tmp_path_factory.mktemp("show")), TEMPLATE)


def _chars(pieces: list[tuple[str, bool]]) -> list[bool]:
    """One mark per character."""
    return [drafted for text, drafted in pieces for _ in text]


def test_flags_follow_the_accept_lengths():
    # prefill 1 token, then steps gaining 3 (2 drafted), 1 (none), 2 (1 drafted)
    assert drafted_flags([1, 3, 1, 2], 7) == [False, True, True, False, False, True, False]
    assert drafted_flags([1, 3, 1, 2], 4) == [False, True, True, False]      # a stop or the limit cut the last step


@pytest.mark.parametrize("method", ["ngram", "plain"])
def test_streamed_marks_are_the_finished_sequence_marks(tiny, method):
    sk = Spekit.load(tiny, method=method, cost_profile="none")
    cfg = SamplingConfig(max_new_tokens=40)
    pieces = list(sk.stream_marked(PROMPT, cfg, chat=False))
    result = sk.last_result
    assert "".join(text for text, _ in pieces) == sk.decode(result.token_ids)
    flags = drafted_flags(result.stats.accept_lengths, len(result.token_ids))
    # every forward's own token is not drafted, except where the length limit cut a step inside its drafts
    assert len(flags) - sum(flags) - result.stats.target_forwards in (0, -1)
    assert _chars(pieces) == _chars(marked_text(sk.tokenizer, result.token_ids, flags, []))
    if method == "plain":
        assert not any(flags)
    else:
        assert any(flags), "this prompt's answer repeats itself: ngram drafts some of it"


def test_generate_colours_only(tiny, capsys):
    base = ["generate", "--model", tiny, "--raw", "--method", "ngram", "--max-new-tokens", "40", "--cost-profile",
            "none"]
    for extra in ([PROMPT], ["--n", "2", "--temperature", "0.8", "--seed", "3", PROMPT]):
        assert main([*base, *extra]) == 0
        plain_out = capsys.readouterr().out
        assert main([*base, "--show-drafts", *extra]) == 0
        shown = capsys.readouterr().out
        assert ANSI.sub("", shown) == plain_out
        assert "\x1b[32m" in shown or "--temperature" in extra      # greedy, this answer repeats: ngram drafts
    assert main([*base, "--show-drafts", "--json", PROMPT]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["drafted"]) == record["new_tokens"] and 0 < sum(record["drafted"]) < record["new_tokens"]
    assert record["new_tokens"] - sum(record["drafted"]) - record["target_forwards"] in (0, -1)


def test_chat_colours_only(tiny, capsys, monkeypatch):
    outs = []
    for flags in ([], ["--show-drafts"]):
        monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
        assert main(["chat", "--model", tiny, "--method", "ngram", "--max-new-tokens", "40", "--cost-profile",
                     "none", *flags]) == 0
        outs.append(capsys.readouterr().out)
    assert ANSI.sub("", outs[1]) == outs[0] and outs[0].strip()
