"""Write a Llama-architecture Hugging Face model as a GGUF file that llama.cpp runs: the tests' tiny random
targets and drafts (built in seconds, no downloads), and a trained spekit draft model for the llama.cpp backend.

The layout is llama.cpp's `llama` architecture: tensor names `token_embd`, `blk.N.attn_q`, ..., `output_norm`,
`output` (left out when the embedding is tied), query and key rows reordered from Hugging Face's rotate-half
rotary layout to the interleaved pairs llama.cpp rotates, and a SentencePiece-style token list (`llama`
tokenizer) with the model's special ids. Written to a temporary file and renamed into place."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..config import UserError

FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}      # llama_ftype of the whole file
NORMAL, UNKNOWN, CONTROL = 1, 2, 3                 # llama.cpp token types


def interleave_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query or key projection [heads * head_dim, in] from rotate-half order (the first half of each head's
    dimensions paired with the second half) to llama.cpp's order (dimension pairs side by side)."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tiny_vocab(size: int) -> list[str]:
    """Token texts for a random test model: <unk>, <s>, </s>, then printable pieces (distinct)."""
    pieces = ["<unk>", "<s>", "</s>"]
    letters = [chr(c) for c in range(33, 127)]
    k = 0
    while len(pieces) < size:
        word = letters[k % len(letters)] * (1 + k // len(letters))
        pieces.append("\u2581" + word if k % 2 else word)
        k += 1
    return pieces[:size]


def write_llama_gguf(model, path: str | os.PathLike, tokens: list[str] | None = None, file_type: str = "f32",
                     bos_id: int = 1, eos_id: int = 2, name: str = "spekit") -> Path:
    """Write `model` (a LlamaForCausalLM, or any model whose config is Llama's) to `path`. tokens: the token
    texts by id (default: `tiny_vocab`); file_type: f32, f16 or q8_0 for the matrices (norms stay f32)."""
    import gguf

    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise UserError(f"writing GGUF is supported for Llama-architecture models, not {config.model_type!r}")
    if file_type not in FILE_TYPES:
        raise UserError(f"file type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    vocab = int(config.vocab_size)
    tokens = tokens or tiny_vocab(vocab)
    if len(tokens) != vocab:
        raise UserError(f"{len(tokens)} token texts for a vocabulary of {vocab}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, "llama")
        _metadata(writer, config, file_type, name)
        _tokenizer(writer, tokens, bos_id, eos_id)
        for key, tensor in _tensors(model):
            _add(writer, key, tensor, file_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _metadata(writer, config, file_type: str, name: str) -> None:
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(FILE_TYPES[file_type])


def _tokenizer(writer, tokens: list[str], bos_id: int, eos_id: int) -> None:
    kinds = [UNKNOWN if i == 0 else CONTROL if t.startswith("<") and t.endswith(">") and len(t) > 2 else NORMAL
             for i, t in enumerate(tokens)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_add_bos_token(False)


def _tensors(model):
    """(GGUF name, float32 array) for every weight, in llama.cpp's layout."""
    config = model.config
    state = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    for i in range(int(config.num_hidden_layers)):
        pre = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", state[pre + "input_layernorm.weight"]
        yield f"blk.{i}.attn_q.weight", interleave_rotary(state[pre + "self_attn.q_proj.weight"], heads)
        yield f"blk.{i}.attn_k.weight", interleave_rotary(state[pre + "self_attn.k_proj.weight"], kv_heads)
        yield f"blk.{i}.attn_v.weight", state[pre + "self_attn.v_proj.weight"]
        yield f"blk.{i}.attn_output.weight", state[pre + "self_attn.o_proj.weight"]
        yield f"blk.{i}.ffn_norm.weight", state[pre + "post_attention_layernorm.weight"]
        yield f"blk.{i}.ffn_gate.weight", state[pre + "mlp.gate_proj.weight"]
        yield f"blk.{i}.ffn_up.weight", state[pre + "mlp.up_proj.weight"]
        yield f"blk.{i}.ffn_down.weight", state[pre + "mlp.down_proj.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if not config.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]


def _add(writer, key: str, tensor: np.ndarray, file_type: str) -> None:
    import gguf

    tensor = np.ascontiguousarray(tensor, dtype=np.float32)
    if tensor.ndim == 1 or file_type == "f32":
        writer.add_tensor(key, tensor)
    elif file_type == "f16":
        writer.add_tensor(key, tensor.astype(np.float16))
    else:
        kind = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(key, gguf.quants.quantize(tensor, kind), raw_dtype=kind)      # (shape read from its bytes)
