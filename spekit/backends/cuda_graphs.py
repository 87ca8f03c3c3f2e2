"""The target step in static shapes, replayed as a CUDA graph (gpt-fast's recipe, on the HF forward).

On a GPU a small model's step costs the launches of a few hundred kernels more than their arithmetic; a CUDA graph
replays the whole forward as one launch. A graph fixes every tensor's shape and address, so the step is put in a
form where nothing changes from one step to the next but the values in a few input buffers:
- the new tokens per row are padded to a width bucket (1, 2, 4, ... 64); padding gets position -1 (a hole);
- attention reads each layer's whole reserved buffer (capacity C slots) under a mask over all C slots, instead of
  the valid view, whose length grows every step;
- the new keys and values are written at slots held in a device tensor (`SlotLayer.static_slots`, index_copy_),
  so the write offset is an input of the graph, not a constant baked into it;
- the cache's bookkeeping (valid count, slot positions) is done on the host after the replay.
One graph per (batch, width, capacity, hidden, buffer addresses), the MAX_GRAPHS most recently used kept. Wider
steps (prefill) and a cache about to outgrow its buffers take the ordinary forward. So that later generations
replay the graphs of earlier ones, the target rounds its caches' capacities up to a few sizes
(`Target.capacity_for`) and hands finished caches' buffers to the next (`cache.BufferPool`); the time spent
recording (`capture_seconds`) is left out of the step costs that drafting decisions are made from.

On a CPU (`capture=False`) the same static step runs the forward itself each time on the same input buffers, with
no graph: the tests use it to check that the static form decodes what the ordinary one does. The capture itself
needs CUDA and has not been run in this project's CI (no GPU there).
"""
from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager

import torch

from ..cache import KVState, SlotLayer, additive_mask

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
# graphs kept: 7 widths x a few capacity buckets x with / without hidden states is what a bench of every method
# over Spec-Bench's short and long prompts meets with few evictions (each one is recorded again when next needed);
# each keeps its outputs (logits [B, W, V], hidden states when asked) in the shared graph pool
MAX_GRAPHS = 48
_CAPTURING = [0.0]   # seconds this process has spent recording graphs (warm-ups included)


def capture_seconds() -> float:
    """Seconds spent recording CUDA graphs so far, in this process: a step that recorded one took that much longer
    than its replays will, so the engine leaves it out of the step costs its drafting decisions are made from."""
    return _CAPTURING[0]


def width_for(n: int) -> int | None:
    return next((w for w in WIDTHS if n <= w), None)


@contextmanager
def static_writes(layers: list[SlotLayer], slots: torch.Tensor):
    """While inside, every layer writes its new keys and values at `slots` [W] and returns its whole buffers."""
    for layer in layers:
        layer.static_slots = slots
    try:
        yield
    finally:
        for layer in layers:
            layer.static_slots = None


class _Graph:
    """Input buffers of one static shape and the step that reads them (captured as a CUDA graph, or not)."""

    def __init__(self, batch: int, width: int, mask_like, device: torch.device):
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.slots = torch.zeros(width, dtype=torch.long, device=device)
        self.mask = {k: torch.zeros_like(v) for k, v in mask_like.items()} if isinstance(mask_like, dict) \
            else torch.zeros_like(mask_like)
        self.replay, self.out = None, None
        self.cache = None               # (KVState, its layers) of the step being run (see StaticStep._run)

    def load(self, tokens, positions, slots, mask) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slots.copy_(slots)
        if isinstance(mask, dict):
            for k, v in mask.items():
                self.mask[k].copy_(v)
        else:
            self.mask.copy_(mask)


def hidden_request(hidden: bool | tuple[int, ...]) -> bool | list[int]:
    """`output_hidden_states` for a forward's `hidden`: all, none, or a list of the indices to keep."""
    return list(hidden) if isinstance(hidden, tuple) else hidden


class StaticStep:
    def __init__(self, forward, capture: bool):
        """forward: the model's forward; capture: record CUDA graphs (else run the static form eagerly)."""
        self.forward, self.capture, self.off = forward, capture, False
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def __call__(self, kv: KVState, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                 hidden: bool | tuple[int, ...]):
        """Like Target.forward (tokens, positions [B, N], tree_mask [B, N, N]), or None where the static form does
        not apply (too wide, the buffers would overflow, no SlotLayers yet). Returns (logits [B, N, V], hidden
        states or None)."""
        layers = kv.cache.layers
        batch, n = tokens.shape
        width = width_for(n)
        ready = layers and all(isinstance(x, SlotLayer) and x.is_initialized for x in layers)
        if self.off or width is None or not ready:
            return None
        start, capacity = layers[0].used, layers[0].capacity_now
        if start + width > capacity or any(x.used != start or x.capacity_now != capacity for x in layers):
            return None
        pad = width - n
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        positions = torch.nn.functional.pad(positions, (0, pad), value=-1)
        mask = static_mask(kv, positions, tree_mask, capacity)
        slots = torch.arange(start, start + width, device=tokens.device)
        key = (batch, width, capacity, hidden,
               tuple((x._keys.data_ptr(), x._values.data_ptr()) for x in layers))
        graph = self.graphs.pop(key, None)
        if graph is None:
            graph = _Graph(batch, width, mask, tokens.device)
        self.graphs[key] = graph
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        graph.load(tokens, positions, slots, mask)
        logits, states = self._run(graph, kv, layers, hidden)
        for layer in layers:
            layer.used = start + n
        kv.appended(positions[:, :n])
        kept = tuple(None if h is None else h[:, :n].clone() for h in states) if hidden else None   # (None: not asked)
        return logits[:, :n].clone(), kept

    def _run(self, graph: _Graph, kv: KVState, layers, hidden: bool | tuple[int, ...]):
        graph.cache = (kv, layers)      # a later generation's cache, with buffers at the addresses recorded

        def step():
            kv, layers = graph.cache
            with static_writes(layers, graph.slots):
                out = self.forward(input_ids=graph.tokens, position_ids=graph.positions.clamp(min=0),
                                   attention_mask=graph.mask, cache=kv.cache, use_cache=True,
                                   output_hidden_states=hidden_request(hidden))
            return out.logits, (out.hidden_states if hidden else None)

        if not self.capture:
            return step()
        # on the model's GPU, not the thread's current one (cuda:0 unless set): a capture on another device's
        # stream does not record the forward's kernels (they run on their own device's stream), so its replays
        # would not recompute the step
        with torch.cuda.device(graph.tokens.get_device()):     # (-1 on a CPU: a no-op)
            if graph.replay is None:
                start = time.perf_counter()
                try:
                    graph.replay, graph.out = _capture(step, self.pool)
                except RuntimeError as err:  # a forward that syncs with the host (e.g. dynamic RoPE) cannot be captured
                    warnings.warn(f"CUDA graphs switched off for this model ({err}); steps run the ordinary forward")
                    self.off = True
                    self.graphs.clear()
                    return step()
                finally:
                    if graph.tokens.is_cuda:
                        torch.cuda.synchronize()
                    _CAPTURING[0] += time.perf_counter() - start
            graph.replay()
            return graph.out


def _capture(step, pool):
    """Warm up on a side stream (as torch's docs require), then record one replayable graph of `step`. The warm-up
    writes keys and values at the step's slots, which are beyond the valid ones: the replay overwrites them."""
    outer = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
    finally:                     # a failed warm-up's kernels are done before the fall-back forward rewrites its slots
        outer.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = step()
    finally:                     # when capture_end raises (an invalidated capture), torch.cuda.graph's __exit__ does
        torch.cuda.set_stream(outer)   # not restore the stream: the ordinary forward would run on its side stream
    return graph.replay, out


def static_mask(kv: KVState, positions: torch.Tensor, tree_mask: torch.Tensor, capacity: int):
    """The additive mask [B, 1, W, C] over all C reserved slots for W new tokens (positions [B, W], the last W - N
    padding) written right after the S valid slots: valid slots as the cache says, the new ones as tree_mask
    [B, N, N] says (padding sees only itself), the rest never."""
    batch, width = positions.shape
    n = tree_mask.shape[1]
    slot_pos = kv.slot_pos                                                              # [B, S]
    s = slot_pos.shape[1]
    allowed = torch.zeros(batch, width, capacity, dtype=torch.bool, device=positions.device)
    allowed[:, :, :s] = (slot_pos >= 0)[:, None, :]
    allowed[:, :n, s:s + n] = tree_mask
    pad = torch.arange(n, width, device=positions.device)
    allowed[:, pad, s + pad] = True
    key_pos = torch.full((batch, capacity), -1, dtype=torch.long, device=positions.device)
    key_pos[:, :s] = slot_pos
    key_pos[:, s:s + width] = positions
    return additive_mask(allowed, key_pos, positions, kv.dtype, kv.sliding_window)
