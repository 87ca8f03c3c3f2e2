"""Structured output: answers that follow a JSON schema or a regular expression, under every method, losslessly.

A constraint is part of the target's distribution: at each place, the tokens the grammar does not allow there get
probability 0 (their logits set to -inf before any other processing), as plain constrained decoding does. Each
node of a draft tree gets the mask of the text on its own path, so the one acceptance rule checks drafts against
the constrained distribution: a drafted token the grammar forbids is rejected (greedy: it is never the argmax;
sampled: its probability is 0), and the output is what plain constrained decoding gives (greedy: token for token;
sampled: the same distribution). Drafters do not see the masks; they lose only the drafts the grammar forbids. The
text it forces next (`Constraint.forced`, StepContext.forced) is drafted by the lookup drafters and grafted onto
the EAGLE heads' trees.

Once the grammar is complete (nothing may follow), the row ends there with finish "stop". Grammars are compiled by
llguidance (the library vLLM and SGLang use for structured output) over the model's fast tokenizer; the core sees
only token ids and masks (`Constraint`).
"""
from __future__ import annotations

import json

import torch

from .config import SamplingConfig, UserError

# JSON answers are laid out as Python's json.dumps does (", " and ": ", no other whitespace): with whitespace free,
# a small model can fill its whole budget with newlines and never close the object. A schema's "x-guidance" key
# overrides it (llguidance's JSON options).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KEPT = 64        # compiled grammars kept per model (a server meets the same schemas again and again)
# llguidance's work limits per mask, 10x its defaults: a string with a maxLength of 200 inside a JSON schema ran out
# of the default lexer fuel in the middle of an answer on SmolLM2 (ParserTooComplex), which ends the grammar
STEP_LEXER_FUEL, STEP_MAX_ITEMS = 2_000_000, 500_000


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise UserError("structured output (json_schema, regex) needs the package llguidance: pip install "
                        "'llguidance>=1.9,<2'") from None
    return llguidance


def grammar_of(cfg: SamplingConfig) -> str | None:
    """The llguidance grammar a row's settings ask for (its JSON schema or its regex), or None."""
    if not cfg.constrained:
        return None
    llguidance = _llguidance()
    if cfg.json_schema:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(cfg.json_schema), defaults=JSON_LAYOUT)
        except ValueError as err:
            raise UserError(f"json_schema is not a JSON schema: {err}") from None
    if cfg.regex:
        return llguidance.LLMatcher.grammar_from_regex(cfg.regex)
    return None


class GrammarError(RuntimeError):
    """llguidance could not go on with a row's grammar (its work limits, say): that row's request fails."""

    def __init__(self, detail: str):
        super().__init__("structured output failed: " + detail.splitlines()[0] if detail else "structured output "
                         "failed")


def one_line(error: str) -> str:
    """llguidance's message on one line: its first line and its `error:` line (it draws a caret under the pattern
    on the lines between)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or [error.strip()]
    cause = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if cause is None else f"{lines[0].rstrip(':')}: {cause[len('error:'):].strip()}"


class Grammars:
    """The model's tokenizer as llguidance reads it (built once, ~1 s), and a `Constraint` per constrained row.
    vocab: the width of the target's logits; eos_ids: the tokens that end an answer (the engine's stop ids)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: tuple[int, ...]):
        self.hf_tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, list(eos_ids)
        self._tokenizer = None
        self._fresh: dict[tuple[str, str], object] = {}   # (json_schema, regex) -> a compiled matcher at its start
                                                          # (rows take copies)

    def tokenizer(self):
        if self._tokenizer is None:
            hf = _llguidance().hf
            try:
                self._tokenizer = hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab,
                                                    eos_token=self.eos_ids or None)
            except Exception as err:       # a slow (Python) tokenizer, or one llguidance cannot read
                raise UserError(f"structured output needs a fast Hugging Face tokenizer: {err}") from None
        return self._tokenizer

    def constraint(self, cfg: SamplingConfig) -> "Constraint | None":
        """The constraint of a row with these settings (UserError for a grammar that does not compile)."""
        if not cfg.constrained:
            return None
        key = (cfg.json_schema, cfg.regex)      # each row of a request asks again: compile the grammar once
        if key not in self._fresh:
            grammar, llguidance = grammar_of(cfg), _llguidance()
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
            if error:
                raise UserError(f"{'json_schema' if cfg.json_schema else 'regex'} cannot be used: {one_line(error)}")
            if len(self._fresh) >= KEPT:
                self._fresh.pop(next(iter(self._fresh)))
            limits = llguidance.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS)
            self._fresh[key] = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=limits)
        return Constraint(self._fresh[key].deep_copy(), self.vocab)


class Constraint:
    """One row's grammar state over its committed tokens: masks for the nodes of a draft tree, and commits."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.words = (vocab + 31) // 32

    @property
    def complete(self) -> bool:
        """Nothing may follow the committed text (the row ends there)."""
        return self.matcher.is_stopped()

    def masks(self, tokens: list[int], parents: list[int], valid: list[bool]) -> torch.Tensor:
        """[N, V] bool, the tokens allowed after each node of a tree (node 0: the committed text; node i: that
        plus the tokens on its path). A node under a forbidden token keeps every token allowed: it is never
        reached, since the forbidden token is rejected."""
        walker = self.matcher.deep_copy()      # drafts are walked on a copy: the row's state moves on commits only
        n = len(tokens)
        bits = torch.full((n, self.words), -1, dtype=torch.int32)              # [N, W] 32 tokens a word
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            if valid[i]:
                children[parents[i]].append(i)

        def visit(node: int) -> None:
            row = bits[node]                                                  # contiguous [W] int32
            walker.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if walker.is_error():
                raise GrammarError(walker.get_error())
            word = bits[node].tolist()
            for child in children[node]:
                tok = tokens[child]
                if tok < self.vocab and (word[tok >> 5] >> (tok & 31)) & 1 and walker.consume_token(tok):
                    visit(child)
                    walker.rollback(1)
        visit(0)
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits[:, :, None] >> shifts) & 1).bool().reshape(n, -1)[:, : self.vocab]

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the grammar forces next (a JSON schema's keys and punctuation, a regex's literal
        text), as llguidance tokenizes the forced text; [] where the next token is free. Lookup drafters draft
        them (StepContext.forced); the model may still prefer another tokenization, so they are verified."""
        if most <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens()[:most])

    def commit(self, tokens: list[int]) -> int:
        """Consume committed tokens; returns how many of them belong to the answer: all, or up to the one that
        completed the grammar."""
        for i, tok in enumerate(tokens):
            if not self.matcher.consume_token(tok):
                raise GrammarError(self.matcher.get_error())
            if self.matcher.is_stopped():
                return i + 1
        return len(tokens)
