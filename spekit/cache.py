"""The KV cache of one model for a batch, with the bookkeeping that ragged batches and trees need.

Every cache slot has a position (`slot_pos`, -1 for a hole: left padding, or a draft slot a shorter row did not
keep). Attention is driven by an explicit 4-D mask built from those positions, so holes cost nothing but memory.
Rollback is `crop`; keeping an accepted tree path is one `gather` of its slots followed by a crop.

The keys and values live in `SlotLayer`s: buffers allocated once for the batch's whole generation (`reserve`),
written in place at the next free slots. A crop only moves the end back (rejected draft slots are overwritten by
the next forward), where transformers' DynamicCache copies the whole cache at every step (torch.cat) and again on
every crop. That copy grows with the context, and a speculative step
crops at almost every step.
"""
from __future__ import annotations

import copy
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 256   # a layer that runs out of reserved slots grows by at least this many (and at least doubles)


class BufferPool:
    """Key and value buffers of finished generations, kept for the next ones (a Target that replays CUDA graphs).

    A captured step is specialised on its cache buffers' addresses (spekit.backends.cuda_graphs): a generation that allocates
    new buffers records every step width again, and a capture (two ordinary forwards, then the recording) costs
    many replayed steps, at every width, for every prompt. Buffers come back
    (`KVState.release`) in the order they were taken and are handed out first in, first out, so a generation
    of the same shape gets every layer's buffers at the addresses the last one had, and its steps replay the
    graphs recorded then. At most `keep` shapes are kept, the least recently used dropped, and at most `most`
    buffers of a shape (a few caches' worth of layers), the oldest dropped."""

    def __init__(self, keep: int = 4, most: int = 512):
        self.keep, self.most = keep, most
        self.free: OrderedDict[tuple, deque] = OrderedDict()

    def __deepcopy__(self, memo) -> "BufferPool":
        return self                      # a copied cache takes from the same pool

    def take(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer of this shape (a kept one when there is one)."""
        spare = self.free.get((tuple(shape), dtype, torch.device(device)))
        if spare:
            return spare.popleft().zero_()
        return torch.zeros(shape, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        key = (tuple(buffer.shape), buffer.dtype, buffer.device)
        self.free.setdefault(key, deque(maxlen=self.most)).append(buffer)
        self.free.move_to_end(key)
        while len(self.free) > self.keep:
            self.free.popitem(last=False)


class SlotLayer(DynamicLayer):
    """One layer's keys and values in buffers [B, H, capacity, D], the first `used` slots valid. `keys`/`values`
    read as the valid views [B, H, used, D]; assigning a tensor to either replaces that buffer (its valid length
    = the tensor's; gathers and merges do this, keys then values)."""

    def __init__(self, capacity: int = 0, store_dtype: torch.dtype | None = None, pool: BufferPool | None = None):
        """store_dtype: keep keys and values in this dtype (default: the model's); see KVState. pool: where the
        buffers are taken from (else allocated)."""
        self.store_dtype, self.pool = store_dtype, pool
        self._keys = self._values = None
        self._keys_used = self._values_used = 0   # valid slots of each buffer (plain ints: copies stay apart)
        self.capacity = capacity
        super().__init__()
        self.static_slots: torch.Tensor | None = None   # [W] slots to write at, whole buffers read (spekit.backends.cuda_graphs)

    @property
    def used(self) -> int:
        return self._keys_used

    @used.setter
    def used(self, count: int) -> None:
        self._keys_used = self._values_used = count

    def _view(self, name: str):
        buffer = getattr(self, name)
        return None if buffer is None else buffer[:, :, :getattr(self, name + "_used")]

    def _replace(self, name: str, tensor) -> None:
        setattr(self, name, tensor)
        setattr(self, name + "_used", 0 if tensor is None else tensor.shape[2])

    keys = property(lambda self: self._view("_keys"), lambda self, t: self._replace("_keys", t))
    values = property(lambda self: self._view("_values"), lambda self, t: self._replace("_values", t))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        dtype = self.store_dtype or key_states.dtype
        # zeros, not garbage: a static step (spekit.backends.cuda_graphs) reads slots past the valid ones, masked, and a NaN
        # there would survive the mask
        self._keys = self._buffer((*key_states.shape[:2], self.capacity, key_states.shape[3]), dtype)
        self._values = self._buffer((*value_states.shape[:2], self.capacity, value_states.shape[3]), dtype)
        self.used, self.is_initialized = 0, True

    def _buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self.pool is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return self.pool.take(shape, dtype, self.device)

    def release(self) -> None:
        """Hand the buffers to the pool (if any) and forget them: the layer reads as never written."""
        if self.pool is not None and self.is_initialized:
            self.pool.give(self._keys)
            self.pool.give(self._values)
        self._keys = self._values = None
        self._keys_used = self._values_used = 0
        self.is_initialized = False

    def copied(self) -> "SlotLayer":
        """A copy with buffers of its own (from the pool, if any) holding the same slots."""
        twin = SlotLayer(self.capacity, self.store_dtype, self.pool)
        if self.is_initialized:
            twin.device = self.device
            twin._keys = twin._buffer(self._keys.shape, self._keys.dtype)
            twin._values = twin._buffer(self._values.shape, self._values.dtype)
            twin._keys[:, :, :self._keys_used] = self._view("_keys")
            twin._values[:, :, :self._values_used] = self._view("_values")
            twin._keys_used, twin._values_used, twin.is_initialized = self._keys_used, self._values_used, True
        return twin

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new [B, H, N, D] keys and values at slots used..used+N; return the valid views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.static_slots is not None:
            self._keys.index_copy_(2, self.static_slots, key_states.to(self._keys.dtype))
            self._values.index_copy_(2, self.static_slots, value_states.to(self._values.dtype))
            return self._keys, self._values
        end = self.used + key_states.shape[2]
        if end > self._keys.shape[2]:
            self._grow(end)
        self._keys[:, :, self.used:end] = key_states
        self._values[:, :, self.used:end] = value_states
        self.used = end
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._keys.shape[2], self._keys.shape[2] + GROW)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = self._buffer((*old.shape[:2], capacity, old.shape[3]), old.dtype)
            new[:, :, :self.used] = old[:, :, :self.used]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.used if self.is_initialized else 0

    @property
    def capacity_now(self) -> int:
        """Slots the buffers hold now (0 before the first write)."""
        return self._keys.shape[2] if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove slots (a negative count, as transformers' caches take it): no copy."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes minus the number of slots to remove")
        if self.is_initialized:
            self.used += tokens_to_remove

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:                       # the buffers themselves: the valid counts stay
            self._keys, self._values = self._keys[indices], self._values[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)


@dataclass(frozen=True)
class Window:
    """A sliding attention window of `size` keys, on the layers of type "sliding_attention" (Gemma 2 / 3, Qwen2
    with max_window_layers: the mask is then a dict by layer type), or on every layer (`everywhere`: Mistral,
    Mixtral, Phi-3, Qwen3-MoE, Starcoder2 and the like, whose config sets sliding_window without layer types)."""
    size: int
    everywhere: bool = False

    @staticmethod
    def of(config) -> "Window | None":
        """The window a model's text config gives its layers, or None."""
        size = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or []
        if not isinstance(size, int) or size <= 0:
            return None
        if "sliding_attention" in layer_types:
            return Window(size)
        return None if layer_types else Window(size, everywhere=True)


class KVState:
    def __init__(self, batch: int, device: torch.device, dtype: torch.dtype, sliding_window: Window | None = None,
                 num_layers: int | None = None, store_dtype: torch.dtype | None = None,
                 pool: BufferPool | None = None):
        """num_layers: make the cache of SlotLayers (sized by `reserve`); without it the layers are transformers'
        DynamicLayers, created as the forward meets them (heads' own caches). store_dtype: the SlotLayers' dtype
        (float64 for spekit.backends.row_invariant's attention, which then converts nothing per step). pool: where the
        SlotLayers take their buffers from, and `release` gives them back."""
        self.cache = DynamicCache()          # one full (non-sliding) layer per model layer; windows live in the mask
        if num_layers is not None:
            self.cache.layers = [SlotLayer(store_dtype=store_dtype, pool=pool) for _ in range(num_layers)]
        self.slot_pos = torch.empty(batch, 0, dtype=torch.long, device=device)   # [B, S]
        self.dtype = dtype
        self.sliding_window = sliding_window

    def reserve(self, slots: int) -> None:
        """Make room for `slots` more slots in every SlotLayer now, so the generation never reallocates."""
        for layer in self.cache.layers:
            if isinstance(layer, SlotLayer):
                layer.capacity = max(layer.capacity, self.length + slots)
                if layer.is_initialized and layer._keys.shape[2] < layer.capacity:
                    layer._grow(layer.capacity)

    def release(self) -> None:
        """This cache is done with: its SlotLayers' buffers go back to their pool (see BufferPool), and the cache
        reads as empty."""
        for layer in self.cache.layers:
            if isinstance(layer, SlotLayer):
                layer.release()
        self.slot_pos = self.slot_pos[:, :0]

    def copied(self) -> "KVState":
        """A copy with buffers of its own: the SlotLayers' from their pool, anything else deep-copied."""
        if not all(isinstance(layer, SlotLayer) for layer in self.cache.layers):
            return copy.deepcopy(self)
        twin = copy.copy(self)
        twin.cache = DynamicCache()
        twin.cache.layers = [layer.copied() for layer in self.cache.layers]
        twin.slot_pos = self.slot_pos.clone()
        return twin

    @property
    def length(self) -> int:
        return self.slot_pos.shape[1]

    @property
    def capacity(self) -> int:
        """Slots its SlotLayers hold now (0 before the first forward, or without SlotLayers)."""
        layer = self.cache.layers[0] if self.cache.layers else None
        return layer.capacity_now if isinstance(layer, SlotLayer) else 0

    def next_positions(self) -> torch.Tensor:
        """Position of the next token of each row: [B] long (number of real tokens in the cache)."""
        return (self.slot_pos >= 0).sum(dim=1)

    def attention_mask(self, positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor | dict:
        """Additive float mask for a forward over N new tokens appended to this cache: see `attention_mask`."""
        return attention_mask(self.slot_pos, positions, tree_mask, self.dtype, self.sliding_window)

    def appended(self, positions: torch.Tensor) -> None:
        """Record the slots the forward just appended: positions [B, N] (-1 for padding tokens)."""
        self.slot_pos = torch.cat([self.slot_pos, positions], dim=1)

    def keep(self, start: int, keep_idx: torch.Tensor, counts: torch.Tensor, in_place: bool | None = None) -> None:
        """Keep, of the slots from `start` on, those at keep_idx [B, M] (offsets from start; the first counts[b]
        of row b are real, the rest become holes), move them to start..start+M and drop everything after.
        in_place: whether every row's real ones are already where they go (keep_idx[b, i] == i), when the caller
        knows (else it is read from the device)."""
        batch, m = keep_idx.shape
        new = self.length - start
        real = torch.arange(m, device=keep_idx.device)[None, :] < counts[:, None]       # [B, M]
        if in_place is None:
            in_place = bool(((keep_idx == torch.arange(m, device=keep_idx.device)) | ~real).all())
        if not in_place:
            self._gather(start, keep_idx)
        pos = self.slot_pos[:, start:].gather(1, keep_idx) if m else self.slot_pos[:, start:start]
        self.slot_pos = torch.cat([self.slot_pos[:, :start], torch.where(real, pos, -1)], dim=1)
        if new - m > 0:
            self.cache.crop(-(new - m))

    @torch.inference_mode()
    def _gather(self, start: int, keep_idx: torch.Tensor) -> None:
        m = keep_idx.shape[1]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)                                        # [B, H, S, D]
                idx = keep_idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
                t[:, :, start:start + m] = t[:, :, start:].gather(2, idx)

    def crop(self, lengths: list[int]) -> None:
        """Row b keeps the tokens at positions below lengths[b]; its later slots become holes (a draft model of
        another vocabulary, whose tokens for the text so far change where the text grew)."""
        limit = torch.tensor(lengths, device=self.slot_pos.device)[:, None]
        self.slot_pos = self.slot_pos.masked_fill(self.slot_pos >= limit, -1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.slot_pos = self.slot_pos[rows]

    @torch.inference_mode()
    def merge(self, other: "KVState") -> None:
        """Append the rows of `other` (of the same model) to this batch: requests joining a running batch. The
        shorter side gets holes in front, so every row keeps its positions. A side without any forward yet
        (no layers, or layers not yet written) contributes holes only."""
        length = max(self.length, other.length)
        mine, theirs = _ready(self.cache.layers), _ready(other.cache.layers)
        if not mine and not theirs:     # neither side written yet (a draft that has not drafted): holes only; the
            self.slot_pos = torch.cat([_pad_front(self.slot_pos, length, -1),     # first forward allocates
                                       _pad_front(other.slot_pos, length, -1)])
            return
        if not mine and theirs:
            self.cache.layers = [copy.copy(layer) for layer in theirs]
            rows = self.slot_pos.shape[0]
            for layer in self.cache.layers:
                layer.keys = layer.keys.new_zeros(rows, layer.keys.shape[1], 0, layer.keys.shape[3])
                layer.values = layer.values.new_zeros(rows, layer.values.shape[1], 0, layer.values.shape[3])
        for i, layer in enumerate(self.cache.layers):
            for name in ("keys", "values"):
                a = getattr(layer, name)                                        # [B1, H, S1, D]
                if theirs:
                    b = getattr(theirs[i], name)                                # [B2, H, S2, D]
                else:
                    b = a.new_zeros(other.slot_pos.shape[0], a.shape[1], 0, a.shape[3])
                setattr(layer, name, torch.cat([_pad_front(a, length), _pad_front(b, length)], dim=0))
        self.slot_pos = torch.cat([_pad_front(self.slot_pos, length, -1), _pad_front(other.slot_pos, length, -1)])

    @torch.inference_mode()
    def compact(self, slack: int = 64) -> bool:
        """When holes (ragged acceptance, left padding, finished rows' leftovers) make up more than `slack` slots
        and a quarter of the cache, move each row's real slots together, in position order and right-aligned
        (shorter rows get holes in front), and drop the rest. One gather per layer. Returns whether it did."""
        batch, length = self.slot_pos.shape
        keep = int((self.slot_pos >= 0).sum(dim=1).max()) if length else 0
        if length - keep <= max(slack, length // 4):
            return False
        order = self.slot_pos.argsort(dim=1, stable=True)[:, length - keep:]  # holes (-1) sort first   [B, M]
        for layer in self.cache.layers:
            idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.slot_pos = self.slot_pos.gather(1, order)
        return True


def attention_mask(slot_pos: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, dtype: torch.dtype,
                   sliding_window: Window | None = None) -> torch.Tensor | dict:
    """Additive float mask for a forward over N new tokens after the S slots whose positions are slot_pos [B, S]
    (-1 for a hole).

    positions: [B, N] long positions of the new tokens; tree_mask: [B, N, N] bool, True where new token i may
    attend new token j (causal for a chain, ancestors for a tree). Returns [B, 1, N, S+N], or a dict by layer
    type when some of the model's layers slide (see Window)."""
    old = (slot_pos >= 0)[:, None, :].expand(-1, positions.shape[1], -1)
    allowed = torch.cat([old, tree_mask], dim=2)                                # [B, N, S+N]
    return additive_mask(allowed, torch.cat([slot_pos, positions], dim=1), positions, dtype, sliding_window)


def additive_mask(allowed: torch.Tensor, key_pos: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                  sliding_window: Window | None = None) -> torch.Tensor | dict:
    """allowed [B, N, K] bool (query i may attend key j), key_pos [B, K] and query positions [B, N] long -> the
    additive mask [B, 1, N, K]: sliding layers also see only the last window, all of them (Window.everywhere) or
    those of type "sliding_attention" (then a dict by layer type)."""
    if sliding_window is None:
        return _additive(allowed, dtype)
    near = positions[:, :, None] - key_pos[:, None, :] < sliding_window.size
    if sliding_window.everywhere:
        return _additive(allowed & near, dtype)
    return {"full_attention": _additive(allowed, dtype), "sliding_attention": _additive(allowed & near, dtype)}


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]   # a Python scalar: no copy from the host


def _ready(layers: list) -> list:
    """The layers when the cache has been written (by a forward), else []."""
    return layers if layers and all(layer.is_initialized for layer in layers) else []


def _pad_front(t: torch.Tensor, length: int, value: int = 0) -> torch.Tensor:
    """Pad the slot axis ([B, S] slot positions, or [B, H, S, D] keys/values) in front to `length` slots."""
    axis = 1 if t.dim() == 2 else 2
    missing = length - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_full(shape, value), t], dim=axis)
