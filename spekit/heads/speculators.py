"""The speculators format (the `speculators` package's checkpoints, which vLLM serves from `vllm serve DIR` through
their `speculators_config`): EAGLE-3 and MTP drafters read into spekit heads and written from them.

The layout, as speculators 0.9.0 saves and loads it (checked against its own code in tests/test_speculators.py):
- config.json: `speculators_model_type` ("eagle3" | "mtp"), `architectures` (["Eagle3DraftModel"] |
  ["MTPDraftModel"]), `transformer_layer_config` (the decoder layer's Hugging Face config: model_type, sizes, rope),
  `speculators_config` {algorithm, proposal_methods [{proposal_type "greedy", speculative_tokens}],
  default_proposal_method, verifier {name_or_path, architectures}}, `speculators_version`.
- eagle3: `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (Hugging Face hidden_states numbering, as spekit's
  `layers`; none = (2, L/2, L-3)), norm flags (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`:
  spekit's layer is the one with all of them false). Tensors: `fc.weight` [H, 3H], `layers.0.*` (q/k/v over 2H,
  `hidden_norm`), `norm.weight`, `lm_head.weight` [Vd, H], `embed_tokens.weight` [V, H] (a copy of the target's;
  left out when spekit writes, speculators and vLLM then take the target's), `d2t` [Vd] and `t2d` [V] when Vd < V.
- mtp: `num_nextn_predict_layers` layers `mtp_layers.{k}.*`: `token_layernorm`, `hidden_layernorm`, `input_proj`
  [H, 2H] over cat(norm(embedding), norm(hidden)), the decoder layer's own names, `final_layernorm`: spekit's MTP
  module (`enorm`, `hnorm`, `eh_proj`, `mtp_block`, `post_norm`) under other names. speculators 0.9.0 holds one
  layer and applies it `speculative_tokens` times; spekit reads that as as many modules with the same weights.
  The embedding and LM head are the target's (not stored). A draft vocabulary (spekit's `draft_vocab`) is not part
  of the format: it travels in config.json's "spekit" object, which other readers ignore.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..config import UserError
from .base import HEADS, Head, check_out, load_head, read_config, read_weights, target_info, write_dir
from .published import check_same, check_target, fill, layer_shape, read_tensors

FORMAT_VERSION = "0.9.0"                     # the speculators release whose layout this reads and writes
SUPPORTED = ("eagle3", "mtp")
EAGLE3_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
MTP_NAMES = (("enorm.", "token_layernorm."), ("hnorm.", "hidden_layernorm."), ("eh_proj.", "input_proj."),
             ("post_norm.", "final_layernorm."), ("mtp_block.", ""))      # spekit's MtpLayer -> speculators'


def read_speculators(directory: Path, config: dict, target) -> Head:
    """A speculators-format drafter as a spekit head for `target` (shapes, vocabulary, layer ids checked)."""
    kind = config.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{directory}: speculators_model_type {kind!r} is not one spekit reads; supported: "
                        f"{', '.join(SUPPORTED)}")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UserError(f"{directory}/config.json has no transformer_layer_config object")
    tensors = {k: v for k, v in read_tensors(directory).items() if not k.startswith("verifier_")}
    head = (_read_eagle3 if kind == "eagle3" else _read_mtp)(directory, config, layer, tensors, target)
    head.meta = dict((config.get("spekit") or {}).get("meta") or {})
    return head


def _read_eagle3(directory: Path, config: dict, layer: dict, tensors: dict, target) -> Head:
    if layer.get("model_type", "llama") != "llama":
        raise UserError(f"{directory}: an EAGLE-3 drafter with a '{layer['model_type']}' decoder layer; spekit's "
                        f"EAGLE-3 layer is Llama's (supported: llama)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{directory}: an EAGLE-3 drafter of {layer['num_hidden_layers']} decoder layers; spekit's "
                        f"has one")
    flags = [f for f in EAGLE3_FLAGS if config.get(f)]
    if flags:
        raise UserError(f"{directory}: this EAGLE-3 drafter sets {', '.join(flags)}; spekit's EAGLE-3 layer has "
                        f"none of {', '.join(EAGLE3_FLAGS)}")
    hidden = int(layer.get("hidden_size", 0))
    if config.get("target_hidden_size") not in (None, hidden):
        raise UserError(f"{directory}: target_hidden_size {config['target_hidden_size']} differs from the draft "
                        f"layer's {hidden}; spekit's EAGLE-3 layer has the target's width")
    ids = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
    check_target(directory, target, hidden, layer.get("vocab_size"), ids, "EAGLE-3 drafter")
    if ids and len(ids) != 3:
        raise UserError(f"{directory}: eagle_aux_hidden_state_layer_ids {ids} fuses {len(ids)} layers; spekit's "
                        f"EAGLE-3 fuses 3")
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        check_same(directory, "embed_tokens.weight", embed, target.model.get_input_embeddings().weight,
                   "token embedding")
    cls = HEADS["eagle3"]
    vocab = target_info(target)["vocab_size"]
    draft = int(config.get("draft_vocab_size") or vocab)
    head = cls(cls.Config(**layer_shape(layer, f"{directory}/config.json"), draft_vocab_size=draft,
                          layers=tuple(ids)), target_info(target))
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    if draft == vocab:                          # no draft vocabulary: speculators stores no mapping
        state.setdefault("d2t", head.d2t.clone())
        state.setdefault("t2d", head.t2d.clone())
    return fill(head, state, directory, "speculators eagle3")


def _read_mtp(directory: Path, config: dict, layer: dict, tensors: dict, target) -> Head:
    from .mtp import MtpConfig, MtpHead, text_config
    arch = text_config(target.model)
    info = target_info(target)
    if layer.get("model_type") != arch.model_type:
        raise UserError(f"{directory} holds MTP layers for a '{layer.get('model_type')}' model, this model is "
                        f"'{arch.model_type}'")
    check_target(directory, target, layer.get("hidden_size"), layer.get("vocab_size"), what="MTP drafter")
    if int(layer.get("num_hidden_layers", info["num_layers"])) != info["num_layers"]:
        raise UserError(f"{directory}: these MTP layers follow a model of {layer['num_hidden_layers']} layers, this "
                        f"model has {info['num_layers']}")
    count = int(config.get("num_nextn_predict_layers") or 1)
    steps = _speculative_tokens(config) or count
    modules = steps if count == 1 else count            # one layer applied `steps` times: as many equal modules
    width = int(layer.get("intermediate_size") or 0)
    extra = config.get("spekit") or {}
    token_map = extra.get("token_map") or []
    mcfg = MtpConfig(modules, 0 if width == int(getattr(arch, "intermediate_size", 0) or 0) else width,
                     len(token_map))
    head = MtpHead(mcfg, {**info, "arch": arch.to_dict()})
    state = {}
    for name, value in tensors.items():
        parts = name.split(".", 2)
        if len(parts) < 3 or parts[0] != "mtp_layers" or not parts[1].isdigit() or int(parts[1]) >= count:
            raise UserError(f"{directory}: unexpected tensor {name} in a speculators MTP drafter of {count} layer(s)")
        rest = parts[2]
        own = next(a + rest[len(b):] for a, b in MTP_NAMES if rest.startswith(b))
        for k in ([int(parts[1])] if count > 1 else range(modules)):
            state[f"layers.{k}.{own}"] = value
    if token_map:
        state["token_map"] = torch.tensor(token_map, dtype=torch.long)
    return fill(head, state, directory, "speculators mtp")


def _speculative_tokens(config: dict) -> int:
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 0)


# --- writing ------------------------------------------------------------------------------------------------------

def export_speculators(head_dir: str | Path, out: str | Path, model: str | None = None) -> Path:
    """Write the EAGLE-3 head or MTP modules in `head_dir` in the speculators format into `out` (atomically).
    model: the verifier named in the config (default: the model the head was trained for)."""
    info = read_config(head_dir)
    if info["kind"] not in SUPPORTED:
        raise UserError(f"the speculators format holds {' and '.join(SUPPORTED)} drafters; {head_dir} holds "
                        f"'{info['kind']}' heads (export them with --to vllm or --to sglang)")
    check_out(out, "export", source=head_dir)
    from .base import TargetShell
    head = load_head(head_dir, TargetShell(info["target"]))
    dtype = next(v.dtype for v in read_weights(head_dir).values() if v.is_floating_point())
    name = model or info["meta"].get("target") or info["target"].get("name") or None
    verifier = {"name_or_path": name, "architectures": list(info["target"].get("arch", {}).get("architectures") or [])}
    tensors, config = (_eagle3_out if info["kind"] == "eagle3" else _mtp_out)(head, dtype)
    if info["kind"] == "eagle3":      # speculators 0.9.0's loader leaves a missing embedding uninitialised: store it
        tensors["embed_tokens.weight"], verifier = _verifier(name, head)
        tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"].to(dtype)
    steps = config.pop("_steps")
    config.update(speculators_model_type=info["kind"], speculators_version=FORMAT_VERSION,
                  dtype=str(dtype).replace("torch.", ""), speculators_config={
                      "algorithm": info["kind"], "default_proposal_method": "greedy", "verifier": verifier,
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}]})
    config["spekit"] = {**config.get("spekit", {}), "kind": info["kind"], "target": info["target"],
                        "meta": info["meta"]}
    return write_dir(out, tensors, config)


def _verifier(name: str | None, head: Head) -> tuple[torch.Tensor, dict]:
    """The target's token embedding [V, H] and the verifier entry naming it (loads the model)."""
    if not name:
        raise UserError("the speculators format stores the target's token embedding and names the target: pass the "
                        "target model with --model")
    from ..backends.torch_models import load_model, resolve
    source = resolve(name)
    if source.kind in ("folder", "hub"):         # the weights alone (no tokenizer needed)
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load --model {name}: {str(err).splitlines()[0][:200]}") from None
    else:
        model = load_model(name).model
    weight = model.get_input_embeddings().weight.detach()
    want = (int(head.target_config["vocab_size"]), int(head.target_config["hidden_size"]))
    if tuple(weight.shape) != want:
        raise UserError(f"--model {name} has an embedding of shape {list(weight.shape)}; the head was made for "
                        f"{list(want)}")
    path = getattr(model.config, "_name_or_path", "") or name
    return weight, {"name_or_path": path, "architectures": list(model.config.architectures or [])}


def _eagle3_out(head: Head, dtype: torch.dtype) -> tuple[dict, dict]:
    from .eagle import rope_parameters
    c = head.config
    vocab = int(head.target_config["vocab_size"])
    tensors = {}
    for name, value in head.state_dict().items():
        if name in ("d2t", "t2d"):
            if c.draft_vocab_size < vocab:
                tensors[name] = value
            continue
        tensors[("layers.0." + name[len("midlayer."):]) if name.startswith("midlayer.") else name] = value.to(dtype)
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
             "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_parameters": rope_parameters(c),
             "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
             "mlp_bias": False, "tie_word_embeddings": False}
    config = {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": c.draft_vocab_size,
              "eagle_aux_hidden_state_layer_ids": head.feature_layers(), "target_hidden_size": None,
              "embed_requires_grad": False, "tie_word_embeddings": False, "transformer_layer_config": layer,
              "_steps": c.ttt_steps, **{f: False for f in EAGLE3_FLAGS}}
    return tensors, config


def _mtp_out(head: Head, dtype: torch.dtype) -> tuple[dict, dict]:
    layers = [m.state_dict() for m in head.layers]
    same = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a in layers for b in layers[:1])
    kept = layers[:1] if same else layers           # equal modules: one layer applied len(layers) times
    if len(kept) > 1:
        print(f"[spekit] {len(kept)} distinct MTP modules: written as num_nextn_predict_layers {len(kept)}; "
              f"speculators {FORMAT_VERSION} loads one layer (spekit reads any number)", file=sys.stderr)
    tensors = {}
    for k, state in enumerate(kept):
        for name, value in state.items():
            own = next(b + name[len(a):] for a, b in MTP_NAMES if name.startswith(a))
            tensors[f"mtp_layers.{k}.{own}"] = value.to(dtype)
    layer = dict(head.target_config["arch"])
    if head.config.intermediate_size:
        layer["intermediate_size"] = head.config.intermediate_size
    config = {"architectures": ["MTPDraftModel"], "num_nextn_predict_layers": len(kept), "tie_word_embeddings":
              False, "transformer_layer_config": layer, "_steps": len(layers)}
    if head.config.draft_vocab:
        config["spekit"] = {"token_map": head.token_map.tolist()}
    return tensors, config

