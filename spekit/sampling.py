"""Logits processing in the order transformers applies it, and sampling with explicit generators.

Order: repetition penalty, temperature, top-k, top-p, min-p. Temperature 0 is greedy: the processed
distribution is the point mass on the argmax of the penalised logits.
"""
from __future__ import annotations

import torch

from .config import SamplingConfig

NEG_INF = float("-inf")


def penalize(logits: torch.Tensor, presence: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """Repetition penalty of CTRL as transformers applies it: divide positive logits of seen tokens, multiply
    negative ones. logits: [..., V] float; presence: [..., V] bool (token seen in the context)."""
    if presence is None or penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(presence, penalised, logits)


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


def target_probs(logits: torch.Tensor, cfg: SamplingConfig, presence: torch.Tensor | None) -> torch.Tensor:
    """The processed distribution [..., V] (float32) that sampling draws from; one-hot argmax when greedy."""
    logits = penalize(logits.float(), presence, cfg.repetition_penalty)
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return warp(logits, cfg).softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, cfg: SamplingConfig, presence: torch.Tensor | None) -> torch.Tensor:
    """Argmax of the penalised logits: [..., V] -> [...] long (ties go to the lowest id, as torch.argmax)."""
    return penalize(logits.float(), presence, cfg.repetition_penalty).argmax(dim=-1)


def make_generators(seeds: list[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per row, so a row's randomness depends only on its own seed and trajectory."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def row_sample(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row from probs [B, V] (rows sum to 1) -> [B] long."""
    assert probs.dim() == 2 and probs.shape[0] == len(gens)
    picks = [torch.multinomial(p.to(g.device), 1, generator=g) for p, g in zip(probs, gens)]
    return torch.cat(picks).to(probs.device)


def presence_of(token_rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Which tokens each row has seen: [B, V] bool."""
    out = torch.zeros(len(token_rows), vocab, dtype=torch.bool, device=device)
    for b, row in enumerate(token_rows):
        if row:
            out[b, torch.tensor(row, device=device)] = True
    return out


def draft_tokens(logits: torch.Tensor, cfg, gens, presence, rows: list[int]):
    """A drafter's next token per row from its processed distribution, for logits [B, V]: (tokens [B], q [B, V] or
    None when greedy, confidence [B] = the top probability). Under sampling only `rows` draw random numbers (from
    their own generators), so a row's stream does not depend on the rest of the batch; they come as a host list
    (which rows still draft under sampling follows from their draft lengths alone), so drawing reads nothing back
    from the device. Other rows get token 0."""
    if cfg.greedy:
        return greedy_tokens(logits, cfg, presence), None, logits.float().softmax(-1).amax(-1)
    q = target_probs(logits, cfg, presence)
    drawn, none = set(rows), torch.zeros(1, dtype=torch.long, device=q.device)
    tok = torch.cat([row_sample(q[b:b + 1], gens[b:b + 1]) if b in drawn else none for b in range(q.shape[0])])
    return tok, q, q.amax(-1)
