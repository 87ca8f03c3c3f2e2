"""Structured output (spekit.grammar): answers follow a regex or a JSON schema, and a grammar is part of the
target's distribution, so every method still gives plain constrained decoding's output: greedy token for token,
sampled the same law."""
from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import SamplingConfig, UserError
from test_cli import _save_tiny
from test_eagle import make_heads
from test_medusa import random_heads
from test_engine import fixed_verify_cost  # noqa: F401

WORDS = r"(the|one|two) [a-z]{2,8}( [a-z]{2,8}){2,5}\."
NUMBERS = r"(one|two|three|four|five|six)( (one|two|three|four|five|six))+\."     # a few tokens allowed at a time
LITERAL = r"(one|two) zebra crossing at noon\."                # all forced after the first word
PROMPT = "one two three four five six seven eight nine ten one two three four five six the quick brown fox"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("g")), _save_tiny(tmp_path_factory.mktemp("g-draft"), layers=1, seed=1)


@pytest.fixture(scope="module")
def plain(folders):
    return Spekit.load(folders[0], cost_profile="none")


@pytest.mark.parametrize("method", ["ngram", "lookahead", "jacobi", "recycle", "draft"])
def test_greedy_answers_follow_the_regex_and_equal_plain(plain, folders, method, fixed_verify_cost):  # noqa: F811
    fixed_verify_cost(1.0)                         # drafting pays: the drafters draft at every chance
    cfg = SamplingConfig(max_new_tokens=80, regex=WORDS)
    want = plain.generate([PROMPT], cfg, chat=False)[0]
    assert re.fullmatch(WORDS, want.text), want.text
    assert want.result.finish_reason == "stop"            # the grammar ended the answer, not the token budget
    free = plain.generate([PROMPT], SamplingConfig(max_new_tokens=len(want.result.token_ids)), chat=False)[0]
    assert free.result.token_ids != want.result.token_ids, "the constraint changed the answer"
    sk = Spekit.load(folders[0], method, draft=folders[1] if method == "draft" else None, cost_profile="none")
    got = sk.generate([PROMPT], cfg, chat=False)[0]
    assert got.result.token_ids == want.result.token_ids
    assert sum(got.result.stats.position_offered) > 0, "drafts were verified under the grammar"


@pytest.fixture(scope="module")
def eagle3_heads(folders, tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(folders[0])
    return make_heads(model, tmp_path_factory.mktemp("g-heads"), "eagle3", draft_vocab_size=model.config.vocab_size,
                      layers=(0, 1, 1))


@pytest.fixture(scope="module")
def medusa_heads(folders, tmp_path_factory):
    return str(random_heads(AutoModelForCausalLM.from_pretrained(folders[0]),
                            tmp_path_factory.mktemp("g-medusa") / "heads", num_heads=3))


@pytest.mark.parametrize("method", ["ngram", "rest", "eagle3", "medusa", "recycle", "lookahead"])
def test_grammar_forced_tokens_are_drafted_and_stay_lossless(plain, folders, method, monkeypatch, eagle3_heads,
                                                            medusa_heads, fixed_verify_cost):  # noqa: F811
    """Text the grammar forces (here all after the first word, and nowhere in the prompt) is drafted by the
    lookup methods and grafted onto the EAGLE and Medusa heads' trees (StepContext.forced): more tokens a forward
    than without it, the same answer as plain."""
    fixed_verify_cost(1.0)
    cfg = SamplingConfig(max_new_tokens=40, regex=LITERAL)
    want = plain.generate([PROMPT], cfg, chat=False)[0]
    assert re.fullmatch(LITERAL, want.text) and want.result.finish_reason == "stop"
    runs = []
    for forced in (True, False):
        if not forced:
            monkeypatch.setattr("spekit.grammar.Constraint.forced", lambda self, most: [])
        options = {"rest": {"datastore": "none", "history_tokens": 0}, "eagle3": {"heads": eagle3_heads},
                   "medusa": {"heads": medusa_heads}}.get(method, {})
        sk = Spekit.load(folders[0], method, cost_profile="none", **options)
        got = sk.generate([PROMPT], cfg, chat=False)[0].result
        assert got.token_ids == want.result.token_ids
        runs.append(got.stats.target_forwards)
    assert runs[0] < runs[1], f"forced drafts saved no forward: {runs}"


def test_json_schema_answers_parse_and_batch_rows_keep_their_own_grammar(plain):
    """In one batch, a JSON row and an unconstrained row: each is what it is alone."""
    cfg = SamplingConfig(max_new_tokens=60, json_schema=json.dumps(SCHEMA))
    [alone] = plain.generate([PROMPT], cfg, chat=False)
    data = json.loads(alone.text)
    assert set(data) == {"name", "n"} and isinstance(data["n"], int) and 0 <= data["n"] <= 99
    sk = plain.with_method("ngram")
    assert sk.generate([PROMPT], cfg, chat=False)[0].result.token_ids == alone.result.token_ids
    both = sk.generate([PROMPT, "one two three four"], cfg, chat=False)
    assert both[0].result.token_ids == alone.result.token_ids
    json.loads(both[1].text)


def _exact_first_two(plain: Spekit, ids: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """The law of the first two tokens of plain constrained sampling: [V * V]."""
    model, vocab = plain.loaded.model, plain.target.vocab_size
    constraint = plain.engine.grammars.constraint(cfg)

    def probs(context: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].float()
        allowed = constraint.masks(context[-1:], [-1], [True])[0]
        logits = logits.masked_fill(~allowed, float("-inf")) / cfg.temperature
        return torch.softmax(logits, -1)

    p1 = probs(ids)
    law = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in p1.nonzero().flatten().tolist():
        assert constraint.matcher.consume_token(t1)
        law[t1] = p1[t1].double() * probs(ids + [t1]).double()
        constraint.matcher.rollback(1)
    return law.flatten()


@pytest.mark.parametrize("method,regex", [("draft", NUMBERS), ("ngram", LITERAL), ("eagle3", LITERAL)])
def test_sampled_answers_follow_the_constrained_law(plain, folders, follows, fixed_verify_cost,  # noqa: F811
                                                    method, regex, eagle3_heads):
    """A draft model that does not know the grammar drafts forbidden tokens too, and ngram drafts the forced
    text's own tokenization while the model may write it in other tokens; the first two tokens of 2000 samples
    still follow plain constrained sampling's law, and nothing outside the grammar comes out."""
    fixed_verify_cost(1.0)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=2, n=2000, seed=3, regex=regex)
    options = {"heads": eagle3_heads} if method == "eagle3" else {}
    sk = Spekit.load(folders[0], method, draft=folders[1] if method == "draft" else None, cost_profile="none",
                     **options)
    ids = sk.encode(PROMPT, chat=False)
    results = sk.engine.generate([ids], cfg)
    vocab = sk.target.vocab_size
    codes = torch.tensor([r.token_ids[0] * vocab + r.token_ids[1] for r in results])
    follows(codes, _exact_first_two(plain, ids, cfg))
    assert sum(r.stats.position_offered[0] for r in results) > 0


def test_bad_grammars_are_one_line_errors(plain, capsys, folders):
    with pytest.raises(UserError, match="not both"):
        SamplingConfig(regex="a", json_schema="{}")
    with pytest.raises(UserError, match="json_schema is not JSON"):
        SamplingConfig(json_schema="{")
    with pytest.raises(UserError, match="regex cannot be used"):
        plain.generate([PROMPT], SamplingConfig(regex="(unclosed"), chat=False)
    assert main(["generate", "--model", folders[0], "--raw", "--regex", "([a-z", "hi"]) == 2
    err = capsys.readouterr().err
    assert "regex cannot be used" in err and "unclosed character class" in err and len(err.splitlines()) == 1, err


def test_the_cli_reads_a_schema_file(folders, tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--model", folders[0], "--raw", "--json", "--max-new-tokens", "60",
                 "--json-schema", f"@{path}", "--", PROMPT]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    assert set(json.loads(out["text"])) == {"name", "n"}
    assert main(["generate", "--model", folders[0], "--json-schema", f"@{tmp_path / 'none.json'}", "hi"]) == 2
    assert "--json-schema file not found" in capsys.readouterr().err
