"""The llama.cpp target backend: a GGUF file run by llama.cpp (through llama-cpp-python) as it ships, quantized,
behind the interface the engine, the proposers and the cost model already use (`spekit.backends.torch_target.Target`'s:
`prefilled`, `forward` over draft tokens, a cache whose `keep` holds the accepted path, measured step costs).

Each row of a batch owns one llama sequence. What llama.cpp computes for a token depends not only on its kernels
(`LlamaSettings.kernels`) but on where its cache cells lie: attention sums over the cells in their order, so the same
keys in other cells (another row's cells between a row's own, a rejected draft's hole) round otherwise. Two layouts:

- kernels "exact" (the default): every row has a cache stream of its own (llama.cpp's non-unified cache), its
  tokens at cells 0, 1, 2, ... as plain decoding puts them, and a step verifies one chain per row (the engine keeps
  a tree's first branch, `chains_only`): the accepted tokens stay where a one-token step would have put them, the
  rest are dropped from the end. Verification logits then equal plain steps' bit for bit.
- kernels "fast": one unified cache. A whole draft tree goes in one decode, its tokens with their positions and
  per-token sequence ids (`llama_seqs.assign`: a sequence per leaf, so each node sees its ancestors; copying a
  sequence only tags cells), logits at every node; after the verdict the accepted path is moved into the row's
  sequence and the rest removed. Lossless up to rounding: a node off the first branch sits in other cells than
  plain decoding would give it.

Rows that finish leave their sequence behind as a prefix (a few are kept, the oldest dropped first): a later prompt
that starts with the same tokens (the next turn of a chat, the same question again) takes that sequence over and
computes only what follows. This backend cannot hand over hidden states (EAGLE, Medusa, MTP) nor run the target's
own layers apart (early exit, layer skip): those methods are refused with the reason (`refusal`)."""
from __future__ import annotations

import contextlib
import ctypes
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..config import UserError
from ..pacing import profiles
from ..pacing.step_costs import StepCosts
from .llama_kv import HOLE, LlamaKV, Row
from .llama_lib import lib, version
from .llama_model import SPARE, LlamaModel, LlamaSettings, context_params
from .llama_prefill import MIN_TOKENS, Prefill
from .llama_seqs import assign
from .torch_models import cache_root

# cost of a forward over n new tokens relative to one, before this run has measured any (greedy calibrates within a
# few steps; sampling always uses it): quantized matrix products on a few CPU cores are compute-bound, so a wide
# forward costs nearly in proportion to its tokens (docs/LLAMACPP.md has the measured curves)
LLAMA_PRIOR = {1: 1.0, 2: 1.8, 4: 2.8, 8: 4.6, 16: 8.5, 32: 16.0, 64: 31.0, 128: 61.0, 256: 120.0, 512: 240.0,
               1024: 480.0}
SEQ_LIMIT = 256          # llama.cpp's LLAMA_MAX_SEQ: sequence ids per (unified) context


class LlamaTarget:
    """The target interface over one llama context. Attributes the engine reads: vocab_size, max_positions, device,
    dtype, costs, compiled / captures (False), config (name, sizes: what heads and datastores are matched by)."""

    backend = "llama.cpp"
    compiled = captures = invariant = False

    def __init__(self, model: LlamaModel, settings: LlamaSettings = LlamaSettings(), cost_profile: str = "auto"):
        L = lib()
        self.L, self.lm, self.settings = L, model, settings
        exact = settings.exact
        # exact: flash attention off, a stream per sequence; fast: llama.cpp's choice of flash attention, one cache
        # whose sequences share cells, so that a tree's branches are copies of the context for free
        params = context_params(L, settings, settings.streams if exact else SEQ_LIMIT, 0 if exact else -1,
                                unified=not exact)
        self.ctx = L.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise UserError(f"llama.cpp could not make a context of {settings.ctx_size} x {settings.streams} tokens "
                            f"for {model.path} (out of memory?): lower --ctx-size or --parallel")
        self.chains_only = exact
        self.mem = L.llama_get_memory(self.ctx)
        ids = settings.streams if exact else SEQ_LIMIT
        self.batch = L.llama_batch_init(settings.batch, 0, ids)
        self.free = list(range(ids - 1, -1, -1))      # sequence ids not in use (popped from the end)
        self.parked: OrderedDict[int, list[int]] = OrderedDict()   # finished rows' sequences: their tokens
        self.vocab_size = model.vocab_size
        self.stop_ids = model.stop_ids
        self.allowed: list[int] | None = None     # a draft's reduced vocabulary: other tokens' logits are -inf
        self._blocked: torch.Tensor | None = None
        self.config = model.config
        self.num_layers = model.config.num_hidden_layers
        # a row's cells: prompts, answers and drafts stay inside them (the engine cuts drafts and answers there)
        self.max_positions = min(model.config.max_position_embeddings or (1 << 30), settings.ctx_size)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.costs = StepCosts(prior=LLAMA_PRIOR)
        self.shared: dict | None = None
        self.credit = 0.0
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self._fast = None            # the prompts' context (llama_prefill.Prefill); False: none for this file
        # a sequence moved in from the prompts' context may not be cut back below this position (its sliding-window
        # layers hold the cells inside the window of the prompt's last position only)
        self.floor: dict[int, int] = {}
        self.window = int(L.llama_model_n_swa(model.ptr))
        profiles.attach(self.costs, self.fingerprint(), cost_profile, cache_root())

    def sibling(self) -> "LlamaTarget":
        """Another context over the same loaded weights and settings, sharing this one's step costs (a bench
        contestant of its own: contexts that several methods take turns on rebuild their compute graph at every
        switch, which one method's run never does)."""
        other = LlamaTarget(self.lm, self.settings, "none")
        other.costs = self.costs
        other._prompts()          # its prompts' context made now (a second load of the file), not in a timed prompt
        return other

    def fingerprint(self) -> dict:
        s = self.settings
        return {"version": profiles.VERSION, "model": "llama.cpp", "dtype": "gguf", "llama_cpp": version(),
                "file": Path(self.lm.path).name, "size": self.lm.size, "threads": s.cores(), "kernels": s.kernels,
                "batch": s.batch, "device": profiles.cpu_device()}

    def __del__(self):
        L = getattr(self, "L", None)
        if L is not None and getattr(self, "ctx", None):
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None

    # -- the target interface ---------------------------------------------------------------------------------

    def new_state(self, batch: int) -> LlamaKV:
        if batch > self.settings.parallel:
            raise UserError(f"{batch} rows at once, and the llama.cpp context was made for {self.settings.parallel}: "
                            f"raise --parallel")
        return LlamaKV(self, [Row(self._take(), [], []) for _ in range(batch)])

    def prefilled(self, prompts: list[list[int]], slots: int, hidden: bool = False):
        """A new cache for these prompts (room for `slots` more tokens each), prefilled: (cache, logits at each
        prompt's last token [B, V], None). A prompt that starts with a kept prefix computes only the rest; within
        `sharing_prefills` an identical prefill is computed once and copied."""
        key = (tuple(map(tuple, prompts)), slots)
        if self.shared is not None and key in self.shared:
            start = time.perf_counter()
            kv, logits, seconds = self.shared[key]
            kv = kv.copied()
            self.credit += max(0.0, seconds - (time.perf_counter() - start))
            return kv, logits, None
        start = time.perf_counter()
        kv = self.new_state(len(prompts))
        kv.reserve(max(len(p) for p in prompts) + slots)
        logits = self.prefill(kv, prompts)
        if self.shared is not None:
            self.shared[key] = (kv.copied(), logits, time.perf_counter() - start)
        return kv, logits, None

    def prefill(self, kv: LlamaKV, prompts: list[list[int]]) -> torch.Tensor:
        """Fill each (empty) row with its prompt, reusing a kept prefix where one matches; a part of MIN_TOKENS or
        more goes through the prompts' context (`llama_prefill`) where there is one. Returns the logits at each
        prompt's last token [B, V]."""
        plans: dict = {None: []}
        moved, last = [], []
        for b, (row, prompt) in enumerate(zip(kv.rows, prompts)):
            reused = self._reuse(row, prompt)
            part = [(b, j, prompt[j], j, (row.seq,)) for j in range(reused, len(prompt))]
            fast = self._prompts() if len(part) >= MIN_TOKENS else None
            if fast is not None:
                if reused:
                    fast.pull(row.seq)
                moved.append(row)
            plans.setdefault(fast, []).extend(part)
            last.append((b, len(prompt) - 1))
            row.tokens.extend(prompt[reused:])
            row.slots = [(t, p, (row.seq,)) for p, t in enumerate(prompt)]
        width = max(len(r.slots) for r in kv.rows)
        for row in kv.rows:
            row.slots = [HOLE] * (width - len(row.slots)) + row.slots
        keys, rows = [], []
        for on, plan in plans.items():
            k, r = self._decode(plan, set(last), on)
            keys, rows = keys + k, rows + [r]
        for row in moved:
            self._fast.push(row.seq)
            self.floor[row.seq] = len(row.tokens) - 1 if self.window else 0
        return torch.cat(rows)[[keys.index(k) for k in last]]

    def _prompts(self):
        """The prompts' context (`llama_prefill.Prefill`, made on first use), or None: --prefill-kernels exact, the
        fast kernels (one context does both), or a file whose cache cannot be moved between the layouts."""
        if self._fast is None and self.settings.exact and self.settings.prefill == "fast":
            fast = Prefill(self.L, self.lm.path, self.settings, self.ctx)
            seq = self._take()
            self._decode([(0, 0, 0, 0, (seq,))], set(), fast)
            self.free.append(seq)
            self._fast = fast if fast.movable(seq) else False
        return self._fast or None

    @torch.inference_mode()
    def forward(self, kv: LlamaKV, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                hidden=False, last_only: bool = False):
        """One decode over N new tokens per row. tokens, positions: [B, N] long (-1: padding); tree_mask [B, N, N]
        bool. Returns (logits [B, N, V] ([B, 1, V] with last_only; zeros at padding), None)."""
        assert not hidden, "the llama.cpp backend hands over no hidden states"
        batch, n = tokens.shape
        toks, pos = tokens.tolist(), positions.tolist()
        chains = _chain_rows(positions, tree_mask) if n > 1 else [True] * batch
        plan, extra = [], []
        for b, row in enumerate(kv.rows):
            local = [[0] if p >= 0 else [] for p in pos[b]] if chains[b] else assign(pos[b], tree_mask[b].tolist())
            ids = {0: row.seq}
            for k in sorted({s for seqs in local for s in seqs} - {0}):
                ids[k] = self._take()
                extra.append((row.seq, ids[k]))
            nodes = [(b, i, toks[b][i], pos[b][i], tuple(ids[s] for s in local[i])) for i in range(n)]
            row.slots.extend((t, p, seqs) for _, _, t, p, seqs in nodes)
            for _, _, t, p, seqs in nodes:
                if p >= 0 and seqs[0] == row.seq:
                    _place(row.tokens, p, t)
            plan.extend(sorted((x for x in nodes if x[3] >= 0), key=lambda x: (x[0], x[3])))
        for src, dst in extra:
            self.L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        outputs = {(b, n - 1) for b in range(batch)} if last_only else {(x[0], x[1]) for x in plan}
        keys, rows = self._decode(plan, outputs)                                            # rows [K, V]
        width = 1 if last_only else n
        slots = [b * width + (0 if last_only else i) for b, i in keys]
        if slots == list(range(batch * width)):          # every node real, in order: no gaps to fill
            out = rows.view(batch, width, self.vocab_size)
        else:
            out = torch.zeros(batch * width, self.vocab_size)
            out[slots] = rows
            out = out.view(batch, width, self.vocab_size)
        if self.allowed is not None:
            out.masked_fill_(self._mask(), float("-inf"))
        return out, None

    @property
    def host_steps(self) -> bool:
        """Whether `one_token` may serve a plain step (not for a draft whose vocabulary is reduced: `allowed`)."""
        return self.allowed is None

    def one_token(self, kv: LlamaKV, tokens: list[int]) -> np.ndarray:
        """A plain step: one decode of tokens[b] at row b's next position. Returns the logits [B, V] float32 as a
        view of llama.cpp's buffer, not a copy: valid until this target's next decode (the engine decides on them at
        once; `forward` copies, since a step's logits may be read after another engine's step in lockstep)."""
        plan = []
        for b, (row, token) in enumerate(zip(kv.rows, tokens)):
            position = len(row.tokens)
            row.slots.append((token, position, (row.seq,)))
            row.tokens.append(token)
            plan.append((b, 0, token, position, (row.seq,)))
        _fill(self.batch, plan, None)
        self._call_decode()
        return self._logits_view(self.ctx, len(plan))

    def _mask(self) -> torch.Tensor:
        """[V] bool: the tokens outside `allowed`."""
        if self._blocked is None:
            self._blocked = torch.ones(self.vocab_size, dtype=torch.bool)
            self._blocked[torch.tensor(self.allowed, dtype=torch.long)] = False
        return self._blocked

    def score(self, prompt: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt [L, V] (in a sequence of its own, dropped after)."""
        seq = self._take()
        try:
            _, rows = self._decode([(0, j, t, j, (seq,)) for j, t in enumerate(prompt)],
                                   {(0, j) for j in range(len(prompt))})
        finally:
            self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.free.append(seq)
        return rows

    @contextlib.contextmanager
    def sharing_prefills(self):
        """Within: identical prefills are computed once (see `prefilled`), as spekit.backends.torch_target.Target's."""
        before, self.shared = self.shared, {}
        try:
            yield
        finally:
            for kv, _, _ in self.shared.values():
                kv.release()
            self.shared = before

    def take_credit(self) -> float:
        credit, self.credit = self.credit, 0.0
        return credit

    def weights_read(self) -> float:
        """Parameters one forward multiplies by: a draft model's cost relative to its target's."""
        return float(self.lm.n_params)

    # -- llama.cpp calls ---------------------------------------------------------------------------------------

    def _decode(self, plan: list[tuple], outputs: set[tuple[int, int]], on=None) -> tuple[list[tuple[int, int]],
                                                                                       torch.Tensor]:
        """Decode `plan` ((row, node, token, position, sequence ids), in an order llama.cpp accepts: each row's
        tokens by position) in calls of at most `settings.batch` tokens, in this context or `on` (the prompts'
        `llama_prefill.Prefill`). Returns the (row, node) pairs of `outputs` in plan order and their logits [K, V]
        (a copy: llama.cpp's buffer is overwritten by the next call)."""
        on = on or self
        keys, parts = [], []
        size = self.settings.batch
        for lo in range(0, len(plan), size):
            part = plan[lo: lo + size]
            wanted = [(b, i) for b, i, *_ in part if (b, i) in outputs]
            _fill(on.batch, part, outputs)
            self._call_decode(on)
            if wanted:
                parts.append(torch.from_numpy(self._logits_view(on.ctx, len(wanted)).copy()))
                keys.extend(wanted)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, self.vocab_size)
        return keys, rows

    def _logits_view(self, ctx, rows: int) -> np.ndarray:
        """llama.cpp's logits buffer as a [rows, V] array (no copy), the views kept by address: making one costs
        more than the step's other host work on a small model, and the buffer moves only when it grows."""
        address = ctypes.cast(self.L.llama_get_logits(ctx), ctypes.c_void_p).value
        view = self._views.get((address, rows))
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            cells = (ctypes.c_float * (rows * self.vocab_size)).from_address(address)
            view = self._views[(address, rows)] = np.frombuffer(cells, np.float32).reshape(rows, self.vocab_size)
        return view

    def _call_decode(self, on=None) -> None:
        on = on or self
        rc = self.L.llama_decode(on.ctx, on.batch)
        if rc == 1 and on is self and self.parked:     # no room: drop the kept prefixes and try once more
            while self.parked:
                self._drop_parked()
            rc = self.L.llama_decode(self.ctx, self.batch)
        if rc == 1:
            raise UserError(f"the llama.cpp context ({self.settings.ctx_size} tokens) is full: raise --ctx-size")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def _commit(self, row: Row, new: list[tuple], kept: list[tuple]) -> None:
        """After a verdict: the row's sequence holds its committed tokens and the kept slots (a path from the
        step's root), every other cell of the step is dropped and the step's extra sequences are freed."""
        real = [s for s in new if s[1] >= 0]
        if not real:
            return
        first = min(s[1] for s in real)
        k = len(kept)
        assert [s[1] for s in kept] == list(range(first, first + k)), "the kept slots are not a path from the root"
        used = set().union(*(s[2] for s in real))
        common = set(used) if not kept else set.intersection(*(set(s[2]) for s in kept))
        best = row.seq if row.seq in common or not kept else min(common)
        rm, cp = self.L.llama_memory_seq_rm, self.L.llama_memory_seq_cp
        rm(self.mem, best, first + k, -1)
        for s in used - {best, row.seq}:
            rm(self.mem, s, -1, -1)
            self.free.append(s)
        if best != row.seq:
            rm(self.mem, row.seq, first, -1)
            cp(self.mem, best, row.seq, first, first + k)
            rm(self.mem, best, -1, -1)
            self.free.append(best)
        del row.tokens[first:]
        row.tokens.extend(s[0] for s in kept)

    def _take(self) -> int:
        """A sequence id not in use: a free one, else the oldest kept prefix's (dropped)."""
        if not self.free and self.parked:
            self._drop_parked()
        if not self.free:
            raise UserError(f"all {self.settings.streams} llama.cpp sequences are in use: raise --parallel")
        seq = self.free.pop()
        self.floor.pop(seq, None)
        return seq

    def _copy(self, row: Row) -> Row:
        """A second row holding the same tokens (exact: its stream's cells copied as they lie; fast: tagged)."""
        seq = self._take()
        self.L.llama_memory_seq_cp(self.mem, row.seq, seq, -1, -1)
        self.floor[seq] = self.floor.get(row.seq, 0)
        return Row(seq, list(row.tokens), list(row.slots))

    def _retire(self, row: Row) -> None:
        """A row leaves: its sequence is kept as a prefix for later prompts (at most SPARE of them, the oldest
        dropped first)."""
        if not row.tokens:
            self.free.append(row.seq)
            return
        self.parked[row.seq] = list(row.tokens)
        while len(self.parked) > SPARE:
            self._drop_parked()

    def drop_prefixes(self) -> None:
        """Forget every kept prefix (a benchmark gives each method its own prompts to compute)."""
        while self.parked:
            self._drop_parked()

    def _drop_parked(self) -> None:
        seq, _ = self.parked.popitem(last=False)
        self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.free.append(seq)

    def _reuse(self, row: Row, prompt: list[int]) -> int:
        """Give the (empty) row the kept sequence that shares the longest start with `prompt` (all but its last
        token at most), cut to that start; how many tokens it holds."""
        best, length = None, 0
        for seq, tokens in self.parked.items():
            n = _common(tokens, prompt, len(prompt) - 1)
            if n > length and n >= self.floor.get(seq, 0):
                best, length = seq, n
        if best is None:
            return 0
        del self.parked[best]
        self.free.append(row.seq)
        row.seq = best
        self.L.llama_memory_seq_rm(self.mem, best, length, -1)
        row.tokens.extend(prompt[:length])
        return length


def _fill(batch, part: list[tuple], outputs: set | None) -> None:
    """llama.cpp's batch holds `part`; logits at the (row, node) pairs of `outputs` (None: at every token)."""
    batch.n_tokens = len(part)
    for k, (b, i, token, position, seqs) in enumerate(part):
        batch.token[k] = token
        batch.pos[k] = position
        batch.n_seq_id[k] = len(seqs)
        ids = batch.seq_id[k]
        for j, s in enumerate(seqs):
            ids[j] = s
        batch.logits[k] = outputs is None or (b, i) in outputs


def _common(a: list[int], b: list[int], most: int) -> int:
    n = 0
    for x, y in zip(a[:most], b[:most]):
        if x != y:
            break
        n += 1
    return n


def _place(tokens: list[int], position: int, token: int) -> None:
    if position == len(tokens):
        tokens.append(token)
    else:
        del tokens[position:]
        tokens.append(token)


def _chain_rows(positions: torch.Tensor, mask: torch.Tensor) -> list[bool]:
    """Per row: whether its real tokens, in node order, sit at consecutive positions and each sees exactly the
    earlier ones (one sequence draws them). positions [B, N], mask [B, N, N]."""
    out = []
    for b in range(positions.shape[0]):
        real = (positions[b] >= 0).nonzero().flatten()
        p = positions[b, real]
        if len(real) > 1 and not bool((p[1:] - p[:-1] == 1).all()):
            out.append(False)
            continue
        sub = mask[b][real][:, real]
        out.append(bool(torch.equal(sub, torch.ones_like(sub).tril())))
    return out
