"""The target's hidden states along the distilled sequences (teacher forcing), cached on disk per layer so that
every head kind reuses them.

Layout under `<data>/features/`:
  len{max_len}/index.json      {"max_len", "shard_size", "num_layers", "hidden_size", "sequences": [[id, length,
                                prompt_length], ...]}   (answers.jsonl's order; sequence i is in shard i // shard_size)
  len{max_len}/tokens.safetensors         one [length] int32 tensor per sequence id
  len{max_len}/L{layer}/{shard:05d}.safetensors   one [length, H] bfloat16 tensor per sequence id of that shard
A sequence is prompt_ids + answer_ids, cut from the left to `max_len` tokens (the hidden states were computed with
that shorter context). Layers are numbered as in FeatureBatch (0 = embeddings, num_layers = after the final norm).
Shards are written to a temporary name and renamed, so an interrupted extraction resumes shard by shard; when
answers.jsonl has grown, the shards of the sequences already seen are kept.
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..config import UserError
from ..heads.base import FeatureBatch
from ..backends.row_invariant import bulk


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class FeatureStore:
    def __init__(self, data: str | Path, answers: list[dict], target, max_len: int = 1024, shard_size: int = 64):
        """answers: records of answers.jsonl, in file order (it is append-only, so that more answers only add
        shards); target: spekit.backends.torch_target.Target (frozen)."""
        self.root = Path(data) / "features" / f"len{max_len}"
        self.target = target
        seqs, too_long = [], 0
        for rec in answers:
            ids = rec["prompt_ids"] + rec["answer_ids"]
            cut = max(0, len(ids) - max_len)
            too_long += len(rec["prompt_ids"]) <= cut
            if len(rec["answer_ids"]) >= 1 and len(rec["prompt_ids"]) > cut:
                seqs.append([rec["id"], len(ids) - cut, len(rec["prompt_ids"]) - cut, ids[cut:]])
        if not seqs:
            hint = f" ({too_long} pass --max-len {max_len} with their prompt: raise it)" if too_long else ""
            raise UserError(f"no usable distilled sequences in {data}{hint}")
        if too_long:
            print(f"[spekit] {too_long} of {len(answers)} distilled answers left out: with their "
                  f"prompt they pass --max-len {max_len} tokens (raise it to train on them)", file=sys.stderr)
        self.index = {"max_len": max_len, "shard_size": shard_size, "num_layers": target.num_layers,
                      "hidden_size": int(target.config.hidden_size), "sequences": [s[:3] for s in seqs]}
        self._keep_valid_shards()
        self.sequences = [(s[0], s[1], s[2]) for s in seqs]
        self.position = {s[0]: i for i, s in enumerate(seqs)}
        tokens_path = self.root / "tokens.safetensors"
        index_path = self.root / "index.json"
        if not index_path.is_file() or json.loads(index_path.read_text()) != self.index or not tokens_path.is_file():
            _atomic_save({s[0]: torch.tensor(s[3], dtype=torch.int32) for s in seqs}, tokens_path)
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = index_path.with_name(".index.json.tmp")
            tmp.write_text(json.dumps(self.index))
            os.replace(tmp, index_path)
        self._tokens = safe_open(str(tokens_path), "pt")
        self._shards: dict[tuple[int, int], object] = {}

    def _keep_valid_shards(self) -> None:
        """Shards whose sequences are unchanged stay (answers only grow); later ones, and all of them when the
        model or layout changed, are deleted."""
        path = self.root / "index.json"
        if not path.is_file():
            return
        old = json.loads(path.read_text())
        same = 0
        if all(old.get(k) == self.index[k] for k in ("max_len", "shard_size", "num_layers", "hidden_size")):
            for a, b in zip(old["sequences"], self.index["sequences"]):
                if a != b:
                    break
                same += 1
        if same == len(old["sequences"]) == len(self.index["sequences"]):
            return
        full = same // self.index["shard_size"]                   # shards wholly inside the unchanged part
        for shard in sorted(self.root.glob("L*/*.safetensors")):
            if int(shard.stem) >= full:
                shard.unlink()

    def _shard_path(self, layer: int, shard: int) -> Path:
        return self.root / f"L{layer}" / f"{shard:05d}.safetensors"

    def num_shards(self) -> int:
        size = self.index["shard_size"]
        return (len(self.sequences) + size - 1) // size

    def ensure(self, layers: list[int], batch_tokens: int = 4096, progress: bool = True) -> None:
        """Compute and store the shards of `layers` that are not on disk yet."""
        for layer in layers:
            if not 0 <= layer <= self.target.num_layers:
                raise UserError(f"a head asked for hidden layer {layer}; this target has 0..{self.target.num_layers}")
        todo = [s for s in range(self.num_shards()) if any(not self._shard_path(l, s).is_file() for l in layers)]
        for shard in tqdm(todo, desc="features", unit="shard", file=sys.stderr, disable=not progress or not todo):
            missing = [l for l in layers if not self._shard_path(l, shard).is_file()]
            size = self.index["shard_size"]
            names = [s[0] for s in self.sequences[shard * size: (shard + 1) * size]]
            states = self._extract(names, missing, batch_tokens)
            for layer in missing:
                _atomic_save({n: states[layer][n] for n in names}, self._shard_path(layer, shard))

    @torch.inference_mode()
    def _extract(self, names: list[str], layers: list[int], batch_tokens: int) -> dict[int, dict[str, torch.Tensor]]:
        """One teacher-forced forward per group of sequences (right-padded); hidden states of `layers`, bf16."""
        model, device = self.target.model, self.target.device
        order = sorted(names, key=lambda n: self.sequences[self.position[n]][1])
        out: dict[int, dict[str, torch.Tensor]] = {l: {} for l in layers}
        group: list[str] = []
        for i, name in enumerate(order + [None]):
            longest = self.sequences[self.position[group[-1]]][1] if group else 0
            if name is not None and (not group or (len(group) + 1) * max(longest, self.length(name)) <= batch_tokens):
                group.append(name)
                continue
            toks = [self.tokens(n) for n in group]
            width = max(len(t) for t in toks)
            ids = torch.zeros(len(toks), width, dtype=torch.long)
            mask = torch.zeros(len(toks), width, dtype=torch.long)
            for b, t in enumerate(toks):
                ids[b, : len(t)], mask[b, : len(t)] = t, 1
            with bulk():     # a prefill: the fused attention kernel (spekit.backends.row_invariant), not the exact forms
                hs = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                           use_cache=False, logits_to_keep=1).hidden_states
            for layer in layers:
                for b, n in enumerate(group):
                    out[layer][n] = hs[layer][b, : len(toks[b])].to("cpu", torch.bfloat16).clone()
            group = [name] if name is not None else []
        return out

    def length(self, name: str) -> int:
        return self.sequences[self.position[name]][1]

    def tokens(self, name: str) -> torch.Tensor:                              # [L] long
        return self._tokens.get_tensor(name).long()

    def hidden(self, layer: int, name: str) -> torch.Tensor:                  # [L, H] bf16
        shard = self.position[name] // self.index["shard_size"]
        key = (layer, shard)
        if key not in self._shards:
            self._shards[key] = safe_open(str(self._shard_path(layer, shard)), "pt")
        return self._shards[key].get_tensor(name)

    def batch(self, names: list[str], layers: list[int], device, dtype=torch.float32) -> FeatureBatch:
        """Right-padded FeatureBatch of these sequences; loss_mask marks positions whose next token is an answer
        token."""
        width = max(self.length(n) for n in names)
        tokens = torch.zeros(len(names), width, dtype=torch.long)
        loss_mask = torch.zeros(len(names), width, dtype=torch.bool)
        hidden = {l: torch.zeros(len(names), width, self.index["hidden_size"], dtype=dtype) for l in layers}
        for b, n in enumerate(names):
            _, length, prompt_len = self.sequences[self.position[n]]
            tokens[b, :length] = self.tokens(n)
            loss_mask[b, prompt_len - 1: length - 1] = True
            for l in layers:
                hidden[l][b, :length] = self.hidden(l, n).to(dtype)
        return FeatureBatch(tokens.to(device), loss_mask.to(device), {l: h.to(device) for l, h in hidden.items()})


def token_batches(lengths: dict[str, int], budget: int, rng: random.Random) -> list[list[str]]:
    """Groups of sequence ids whose padded size (count x longest) stays within `budget` tokens (a longer sequence
    goes alone); similar lengths together, groups in random order."""
    names = sorted(lengths, key=lambda n: (lengths[n], n))
    groups, group = [], []
    for n in names:
        if group and (len(group) + 1) * lengths[n] > budget:
            groups.append(group)
            group = []
        group.append(n)
    if group:
        groups.append(group)
    rng.shuffle(groups)
    return groups


def epochs(lengths: dict[str, int], budget: int, seed: int) -> Iterator[list[str]]:
    """Batches forever: every epoch the same groups in a new order (seeded)."""
    rng = random.Random(seed)
    while True:
        yield from token_batches(lengths, budget, rng)
