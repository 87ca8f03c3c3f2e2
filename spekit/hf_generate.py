"""A drop-in for transformers' `model.generate` on code that already has a model and input ids:

    out = spekit.hf_generate.generate(model, **inputs, max_new_tokens=128, method="eagle3-lookup")   # was model.generate

Tokens in, tokens out, as transformers shapes them: `input_ids` [B, L] (left padding with `attention_mask`), and
back [B * num_return_sequences, L + T], each row its input as given, then its new tokens, right-padded with
`pad_token_id` after the ones that ended early. The settings transformers reads (max_new_tokens, do_sample,
temperature, top_k, top_p, min_p, repetition_penalty, eos_token_id, pad_token_id, num_return_sequences) are taken
from the call, else from `model.generation_config`; a sampled call draws its seed from torch's global generator,
so `torch.manual_seed` repeats it. Greedy output is plain decoding's, token for token, under every method; sampled,
the same distribution. What speculative decoding cannot do here (beam search, contrastive search, an assistant
model of transformers' own, returning scores) is refused rather than ignored.

`patch(model, method=...)` makes `model.generate` this function, so that code calling it (transformers' text
generation pipeline too) decodes speculatively; `unpatch` gives it back.

The model is switched in place to spekit's forward forms on the first call (see spekit.backends.torch_target.Target) and keeps
them; the engine per method is kept with it, so later calls start at once."""
from __future__ import annotations

import dataclasses
import functools
import weakref

import torch

from .api import check_method, shipped_draft
from .methods import build_engine, resolve_method
from .config import SamplingConfig, UserError
from .engine import Engine
from .backends.torch_models import LoadedModel, ModelSource
from .proposers import get as get_method
from .backends.torch_target import Target

# what transformers' generate takes and speculative decoding does not do: refused, since ignoring them would give
# another output than the caller asked for
REFUSED = ("num_beams", "num_beam_groups", "penalty_alpha", "assistant_model", "prompt_lookup_num_tokens",
           "output_scores", "output_logits", "return_dict_in_generate", "constraints", "force_words_ids",
           "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "typical_p",
           "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "bad_words_ids", "diversity_penalty",
           "length_penalty", "min_length", "max_length", "stop_strings")
IGNORED = ("use_cache", "output_attentions", "output_hidden_states", "synced_gpus")   # no effect on the tokens
_engines: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, method: str = "plain",
             draft_model=None, max_new_tokens: int | None = None, min_new_tokens: int | None = None,
             do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, repetition_penalty: float | None = None, eos_token_id=None,
             pad_token_id: int | None = None, num_return_sequences: int | None = None,
             seed: int | None = None, generation_config=None, streamer=None, tokenizer=None,
             assistant_tokenizer=None, **options) -> torch.Tensor:
    """model.generate's output for these inputs, decoded by `method` (its options as keywords: heads=DIR,
    num_draft_tokens=8, ...). draft_model: a smaller model for method "draft", of the same vocabulary, or of
    another with `tokenizer` (the model's) and `assistant_tokenizer` (the draft's), as transformers' universal
    assisted generation takes them;
    generation_config: read instead of the model's, as transformers does; streamer: a transformers streamer
    (TextStreamer, TextIteratorStreamer), given the prompt, then each step's new tokens, as model.generate gives
    them (one input row, one sequence)."""
    refused = sorted(k for k, v in options.items() if k in REFUSED and v not in (None, False, 1))
    if refused:
        raise UserError(f"spekit.hf_generate.generate does not do {', '.join(refused)}: speculative decoding replaces "
                        "greedy decoding and sampling only")
    options = {k: v for k, v in options.items() if k not in REFUSED and k not in IGNORED}
    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)

    def pick(given, name: str, default):
        """The call's value, else the model's generation config's, else transformers' default."""
        if given is not None:
            return given
        value = getattr(gc, name, None)
        return default if value is None else value

    sampled = pick(do_sample, "do_sample", False)
    eos = pick(eos_token_id, "eos_token_id", None)
    stops = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    pad = pick(pad_token_id, "pad_token_id", stops[0] if stops else 0)
    n = pick(num_return_sequences, "num_return_sequences", 1)
    if seed is None and sampled:
        seed = int(torch.randint(0, 2 ** 62, (1,)))       # from torch's generator: torch.manual_seed repeats it
    cfg = SamplingConfig(
        max_new_tokens=pick(max_new_tokens, "max_new_tokens", 20),
        min_new_tokens=pick(min_new_tokens, "min_new_tokens", 0),
        temperature=pick(temperature, "temperature", 1.0) if sampled else 0.0,
        top_k=pick(top_k, "top_k", 0) if sampled else 0, top_p=pick(top_p, "top_p", 1.0) if sampled else 1.0,
        min_p=pick(min_p, "min_p", 0.0) if sampled else 0.0,
        repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0), n=n, seed=seed or 0)
    prompts = _prompts(input_ids, attention_mask)
    engine = _engine(model, method, draft_model, options, stops, (tokenizer, assistant_tokenizer))
    if streamer is None:
        results = engine.generate(prompts, cfg)
    else:
        results = _streamed(engine, prompts, cfg, streamer)
    new = [r.token_ids for r in results]
    width = max(len(t) for t in new)
    rows = input_ids.repeat_interleave(n, dim=0)
    tail = torch.full((len(new), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, tokens in enumerate(new):
        tail[i, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([rows, tail], dim=1)


def patch(model, method: str = "plain", **options):
    """Make `model.generate` this module's `generate` with these settings, on this model object only, so that
    code which calls it, transformers' pipelines included, decodes with `method`. Returns the model; `unpatch`
    undoes it."""
    check_method(method)                            # an unknown method fails here, not at the first call
    if not hasattr(model, "_spekit_generate"):
        model._spekit_generate = model.generate     # the bound original, for unpatch
    model.generate = functools.partial(generate, model, method=method, **options)
    return model


def unpatch(model):
    """Give `model.generate` back to transformers (after `patch`)."""
    if hasattr(model, "_spekit_generate"):
        del model.generate                          # the instance attribute: the class's method shows again
        del model._spekit_generate
    return model


def _streamed(engine: Engine, prompts: list[list[int]], cfg: SamplingConfig, streamer) -> list:
    """One sequence decoded with its tokens put to the streamer as they are committed."""
    if len(prompts) != 1 or cfg.n != 1:
        raise UserError("a streamer takes one sequence: one input row and num_return_sequences 1")
    streamer.put(torch.tensor([prompts[0]]))
    results = []
    try:
        for event in engine.stream(prompts, cfg):
            if event.tokens:
                streamer.put(torch.tensor(event.tokens))
            if event.result is not None:
                results.append(event.result)
    finally:
        streamer.end()
    return results


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's real tokens (its padding, where the mask is 0, left out)."""
    if input_ids.dim() != 2:
        raise UserError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    if attention_mask is None:
        return ids
    if attention_mask.shape != input_ids.shape:
        raise UserError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                        f"{tuple(input_ids.shape)}")
    return [[t for t, m in zip(row, mask) if m] for row, mask in zip(ids, attention_mask.tolist())]


def _engine(model, method: str, draft_model, options: dict, stops: tuple[int, ...],
            tokenizers=(None, None)) -> Engine:
    """The model's engine for this method ("auto": spekit.methods.auto_method's), options, draft and stop tokens
    (tokenizers: the model's and the draft's, for a draft of another vocabulary): built once, kept with the model."""
    kept = _engines.setdefault(model, {})
    if "target" not in kept:
        kept["target"] = Target(model)
    target = kept["target"]
    method = resolve_method(method, target)[0]
    cls = get_method(method)
    stray = sorted(set(options) - {f.name for f in dataclasses.fields(cls.Options)})
    if stray:
        raise UserError(f"spekit.hf_generate.generate does not know {', '.join(stray)}: neither a setting of transformers' "
                        f"generate that it reads nor an option of method '{method}'")
    key = (method, tuple(sorted(options.items())), id(draft_model), stops, tuple(map(id, tokenizers)))
    if key not in kept:
        draft = None
        if draft_model is not None:
            if not cls.needs_draft_model:
                raise UserError(f"method '{method}' does not use a draft model")
            draft = Target(draft_model)
            if tokenizers[1] is not None:
                draft.tokenizer = tokenizers[1]
        elif cls.needs_draft_model:
            name = str(getattr(model.config, "_name_or_path", "") or "model")
            found = shipped_draft(LoadedModel(model, None, ModelSource(name, name, None, "object")))
            if found is None:
                raise UserError(f"method '{method}' needs draft_model=, a smaller model of the same vocabulary")
            draft = Target(found.model)
        kept[key] = build_engine(target, method, options, draft, stop_ids=stops, tokenizer=tokenizers[0])
    return kept[key]
