"""Logits processing in the order of SamplingConfig, and sampling with explicit generators.

Order: logit bias, repetition penalty, frequency and presence penalties, temperature, top-k, top-p, min-p.
Temperature 0 is greedy: the processed distribution is the point mass on the argmax of the penalised logits.
What the penalties need to know of a row's context travels as a `Seen`; at a node of a draft tree it is the
committed context plus the tokens on the node's path (acceptance.py), so that every node's distribution is the
one plain decoding would have there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import SamplingConfig, UserError

NEG_INF = float("-inf")


@dataclass
class Seen:
    """What the logits processing needs of each row's context, [..., K] each (None where the settings need no
    such thing): presence, bool, the token occurs anywhere in the context, prompt included (repetition penalty,
    as transformers); counts, float, its occurrences among the generated tokens only (frequency and presence
    penalties, as OpenAI and vLLM). cols [K] long, ascending: the vocabulary ids the K columns stand for (the
    tokens a tree's contexts hold, so that a tree's nodes are processed over those columns only); None: K = V,
    every id in order."""

    presence: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """A drafter's tokens [R] join the contexts of rows [R] (distinct), only where `where` [R] bool holds.
        Dense (cols None) only."""
        assert self.cols is None
        if self.presence is not None:
            self.presence[rows, tokens] = True if where is None else self.presence[rows, tokens] | where
        if self.counts is not None:
            self.counts[rows, tokens] += 1.0 if where is None else where.float()


def seen_of(contexts: list[list[int]], starts: list[int], cfg: SamplingConfig, vocab: int,
            device: torch.device | str) -> Seen | None:
    """The Seen of rows whose contexts are `contexts` (prompt + generated) and whose generated tokens begin at
    `starts`; None when the settings penalise nothing."""
    wants_presence, wants_counts = cfg.repetition_penalty != 1.0, cfg.penalizes_output
    if not (wants_presence or wants_counts):
        return None
    presence = torch.zeros(len(contexts), vocab, dtype=torch.bool, device=device) if wants_presence else None
    counts = torch.zeros(len(contexts), vocab, device=device) if wants_counts else None
    for b, (row, start) in enumerate(zip(contexts, starts)):
        if presence is not None and row:
            presence[b, torch.tensor(row, device=device)] = True
        if counts is not None and row[start:]:
            counts[b].index_add_(0, torch.tensor(row[start:], device=device),
                                 torch.ones(len(row) - start, device=device))
    return Seen(presence, counts)


def check_bias(cfg: SamplingConfig, vocab: int) -> None:
    """UserError when a logit bias names a token the vocabulary does not have."""
    bad = [tok for tok, _ in cfg.logit_bias if tok >= vocab]
    if bad:
        raise UserError(f"logit bias for token id {bad[0]}, but the vocabulary has {vocab} tokens (0..{vocab - 1})")


def check_token_ids(cfg: SamplingConfig, vocab: int) -> None:
    """UserError when a logit bias or a stop id names a token the vocabulary does not have (once a request, not
    at every step as `penalize`'s check of the bias)."""
    check_bias(cfg, vocab)
    bad = [tok for tok in cfg.stop_ids if tok >= vocab]
    if bad:
        raise UserError(f"stop id {bad[0]} is not a token: the vocabulary has {vocab} tokens (0..{vocab - 1})")


def untouched(cfg: SamplingConfig) -> bool:
    """Whether `penalize` leaves every logit as the target gave it under these settings."""
    return not cfg.logit_bias and cfg.repetition_penalty == 1.0 and not cfg.penalizes_output


def penalize(logits: torch.Tensor, seen: Seen | None, cfg: SamplingConfig) -> torch.Tensor:
    """Logit bias, then the penalties, on [..., V] float logits (returned as they are when nothing applies, else
    a new tensor). Repetition penalty of CTRL as transformers applies it: divide positive logits of seen tokens,
    multiply negative ones. Frequency and presence penalties as OpenAI defines them: minus count *
    frequency_penalty, minus presence_penalty once a token was generated."""
    penalties = seen is not None and ((seen.presence is not None and cfg.repetition_penalty != 1.0)
                                      or (seen.counts is not None and cfg.penalizes_output))
    if not (cfg.logit_bias or penalties):
        return logits
    out = logits.to(torch.float32, copy=True)
    if cfg.logit_bias:
        check_bias(cfg, out.shape[-1])
        ids, bias = zip(*cfg.logit_bias)
        out[..., list(ids)] += torch.tensor(bias, device=out.device)
    if not penalties:
        return out
    if seen.cols is None:
        return _penalties(out, seen, cfg)
    return out.index_copy_(out.dim() - 1, seen.cols, _penalties(out[..., seen.cols], seen, cfg))


def _penalties(logits: torch.Tensor, seen: Seen, cfg: SamplingConfig) -> torch.Tensor:
    """The penalties on logits [..., K] over the columns of `seen`."""
    if seen.presence is not None and cfg.repetition_penalty != 1.0:
        penalised = torch.where(logits < 0, logits * cfg.repetition_penalty, logits / cfg.repetition_penalty)
        logits = torch.where(seen.presence, penalised, logits)
    if seen.counts is not None and cfg.penalizes_output:
        logits = logits - seen.counts * cfg.frequency_penalty - (seen.counts > 0).float() * cfg.presence_penalty
    return logits


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [..., V] float logits; removed tokens get -inf. Not for greedy."""
    assert cfg.temperature > 0
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - cfg.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    if cfg.min_p > 0:
        probs = logits.softmax(dim=-1)
        floor = cfg.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def target_probs(logits: torch.Tensor, cfg: SamplingConfig, seen: Seen | None) -> torch.Tensor:
    """The processed distribution [..., V] (float32) that sampling draws from; one-hot argmax when greedy."""
    logits = penalize(logits.float(), seen, cfg)
    if cfg.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    return warp(logits, cfg).softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, cfg: SamplingConfig, seen: Seen | None) -> torch.Tensor:
    """Argmax of the penalised logits: [..., V] -> [...] long (ties go to the lowest id, as torch.argmax)."""
    return argmax(penalize(logits.float(), seen, cfg))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): [..., V] -> [...] long, the first of tied maxima. A float32 tensor in host memory goes
    through numpy's argmax, which scans a large vocabulary in a fraction of torch's time on a few cores (the same
    index: both take the first maximum)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.shape[-1] > 0:
        return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1), dtype=np.int64)).reshape(x.shape[:-1])
    return x.argmax(dim=-1)


def make_generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per row, so a row's randomness depends only on its own seed and trajectory."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def row_sample(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row from probs [B, V] (rows sum to 1) -> [B] long."""
    assert probs.dim() == 2 and probs.shape[0] == len(gens)
    picks = [torch.multinomial(p.to(g.device), 1, generator=g) for p, g in zip(probs, gens)]
    return torch.cat(picks).to(probs.device)


def draft_tokens(logits: torch.Tensor, cfg, gens, seen: Seen | None, rows: list[int]):
    """A drafter's next token per row from its processed distribution, for logits [B, V]: (tokens [B], q [B, V] or
    None when greedy, confidence [B] = the top probability). Under sampling only `rows` draw random numbers (from
    their own generators), so a row's stream does not depend on the rest of the batch; they come as a host list
    (which rows still draft under sampling follows from their draft lengths alone), so drawing reads nothing back
    from the device. Other rows get token 0."""
    if cfg.greedy:
        return greedy_tokens(logits, cfg, seen), None, logits.float().softmax(-1).amax(-1)
    q = target_probs(logits, cfg, seen)
    drawn, none = set(rows), torch.zeros(1, dtype=torch.long, device=q.device)
    tok = torch.cat([row_sample(q[b:b + 1], gens[b:b + 1]) if b in drawn else none for b in range(q.shape[0])])
    return tok, q, q.amax(-1)
