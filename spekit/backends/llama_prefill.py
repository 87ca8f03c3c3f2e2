"""Prompts through llama.cpp's fast kernels, answers through the exact ones (`LlamaSettings.prefill` "fast").

The exact kernels forgo flash attention and repacked weights so that a verification forward gives every token the
logits of a one-token step. A prompt needs no such thing: only its cache rows and its last logits are used, and
every method computes its prompts the same way, so greedy output still equals this backend's plain decoding. So a
prompt part of MIN_TOKENS or more is decoded by a second context on the same file, with flash attention and
repacked weights (faster on long prompts: `scripts/llama_cost.py --prefill` measures it, docs/LLAMACPP.md has the
figures), and its cells are moved into the exact context with llama.cpp's sequence state calls.

Flash attention keeps a cache's V rows as they are, the exact context keeps them transposed, and llama.cpp will not
load a state of the other layout: `relayout` transposes them in the state's bytes (llama-cpp-python 0.3.x's
format, checked as it is read; a file or build whose state it cannot read keeps every prompt in the exact context).
A sliding-window layer's state holds only the cells inside the window of the sequence's last position, so a moved
sequence may not be cut back below that position (`LlamaTarget._reuse` reads `floor`)."""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from ..config import UserError
from .llama_model import context_params

MIN_TOKENS = 64     # shorter prompt parts (a chat's next turn, a short question) stay in the exact context: the second
                    # context costs a second load of the file the first time a prompt needs it
_ELEMENT = {0: np.uint32, 1: np.uint16, 30: np.uint16}    # V cache types that can be transposed: f32, f16, bf16


class Unmovable(Exception):
    """A sequence state this code cannot read (another format, a quantized V cache, per-cell extras)."""


def relayout(state: np.ndarray, transposed: bool) -> np.ndarray:
    """A sequence's state (uint8 [n], llama_state_seq_get_data's bytes) with its V rows made `transposed` (the exact
    context's layout) or not (flash attention's). The layout, per cache (a sliding-window model has two): stream
    count; per stream a cell count, then per cell its position and sequence ids, then V's layout flag, the layer
    count, each layer's K rows [cells, row bytes], each layer's V as rows [cells, n] or transposed [n, cells]."""
    out, raw = state.copy(), memoryview(state)
    at = 8                                      # magic, sequence id
    try:
        while at < len(raw):
            (streams,) = struct.unpack_from("<I", raw, at)
            at += 4
            for _ in range(streams):
                (cells,) = struct.unpack_from("<I", raw, at)
                at += 4
                if cells:
                    at = _stream(raw, out, at, cells, transposed)
    except struct.error as err:
        raise Unmovable(f"the state ends early ({err})") from None
    if at != len(raw):
        raise Unmovable(f"the state was read to byte {at} of {len(raw)}")
    return out


def _stream(raw: bytes, out: np.ndarray, at: int, cells: int, transposed: bool) -> int:
    """Relayout one stream's cells (from `at`, just past its cell count) into `out`; where the stream ends."""
    for _ in range(cells):                      # position, number of sequence ids (1: one sequence's state), ids
        (ids,) = struct.unpack_from("<I", raw, at + 4)
        if ids != 1:
            raise Unmovable(f"a cell with {ids} sequence ids")
        at += 12
    v_trans, layers = struct.unpack_from("<II", raw, at)
    if v_trans == transposed:
        raise Unmovable("the state is in the layout asked for already")
    out[at: at + 4] = np.frombuffer(struct.pack("<I", transposed), np.uint8)
    at += 8
    for _ in range(layers):                     # K: type, row bytes, rows
        _, row = struct.unpack_from("<iQ", raw, at)
        at += 12 + cells * row
    for _ in range(layers):
        if v_trans:                             # type, element bytes, elements per cell, [n, cells]
            kind, size, n = struct.unpack_from("<iII", raw, at)
            shape = (n, cells)
        else:                                   # type, row bytes, [cells, n]
            kind, row = struct.unpack_from("<iQ", raw, at)
            size = np.dtype(_ELEMENT.get(kind, np.uint8)).itemsize
            n, shape = row // size, (cells, row // size)
        if kind not in _ELEMENT or np.dtype(_ELEMENT[kind]).itemsize != size:
            raise Unmovable(f"a V cache of ggml type {kind}")
        body = at + 12
        end = body + cells * n * size
        if end > len(raw):
            raise Unmovable("a layer runs past the state's end")
        rows = np.frombuffer(raw, _ELEMENT[kind], cells * n, body).reshape(shape)
        header = struct.pack("<iII", kind, size, n) if transposed else struct.pack("<iQ", kind, n * size)
        out[at: body] = np.frombuffer(header, np.uint8)
        out[body: end] = np.ascontiguousarray(rows.T).view(np.uint8).reshape(-1)
        at = end
    return at


class Prefill:
    """The second context: the same file loaded with repacked weights, flash attention on, a stream per sequence id
    as the exact context has. The target decodes prompt parts here (`LlamaTarget._decode(..., on=this)`); `pull` /
    `push` move a sequence in from the exact context `home` and back."""

    def __init__(self, L, path: str, settings, home):
        self.L, self.home = L, home
        params = L.llama_model_default_params()
        params.use_extra_bufts = True
        params.n_gpu_layers = 0
        self.ctx = None
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise UserError(f"llama.cpp could not load {path} a second time (for prompts): use --prefill-kernels exact")
        params = context_params(L, settings, settings.streams, flash=1, unified=False)
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise UserError("llama.cpp could not make a second context for prompts (out of memory?): "
                            "use --prefill-kernels exact or lower --ctx-size")
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(settings.batch, 0, settings.streams)

    def __del__(self):
        if getattr(self, "ctx", None):
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def movable(self, seq: int) -> bool:
        """Whether this file's cache moves between the layouts: sequence `seq` (decoded here) has a state
        `relayout` reads. The sequence is removed after."""
        try:
            relayout(self._state(self.ctx, seq), transposed=True)
            return True
        except Unmovable:
            return False
        finally:
            self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def pull(self, seq: int) -> None:
        """The exact context's sequence `seq`, copied here (cut where the caller has cut it)."""
        self._set(self.ctx, seq, relayout(self._state(self.home, seq), transposed=False))

    def push(self, seq: int) -> None:
        """Sequence `seq` moved from here into the exact context (replacing what it held there)."""
        state = relayout(self._state(self.ctx, seq), transposed=True)
        self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self._set(self.home, seq, state)

    def _state(self, ctx, seq: int) -> np.ndarray:
        size = self.L.llama_state_seq_get_size(ctx, seq)
        buf = np.empty(size, np.uint8)
        n = self.L.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
        if n == 0:
            raise RuntimeError(f"llama.cpp could not read sequence {seq}'s state")
        return buf[:n]

    def _set(self, ctx, seq: int, state: np.ndarray) -> None:
        n = self.L.llama_state_seq_set_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), state.size,
                                            seq)
        if n != state.size:
            raise RuntimeError(f"llama.cpp could not load sequence {seq}'s state ({n} of {state.size} bytes)")
