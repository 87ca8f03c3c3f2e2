"""The tools a user would otherwise use, on the same prompts: Hugging Face `generate` (plain, prompt lookup,
assistant model, assistant early exit) on an untouched copy of the model, and llama.cpp (plain and its
prompt-lookup drafter) on the same GGUF file when the optional `llama_cpp` module is importable. Peers run one
prompt at a time (HF's assisted generation takes batch 1 only); they report no forwards or acceptance.

llama.cpp's peers can also be taken one token at a time (`Contestant.steps`), since llama-cpp-python's `generate`
is itself a generator: with `--lockstep` they take their turns among the spekit methods (lockstep.py). The HF
peers run whole answers only: transformers' `generate` returns when the answer is done, and stepping it would
mean driving its loop from outside (a streamer thread, or a `StoppingCriteria` that blocks), which would time
that machinery along with the model."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from pathlib import Path

import torch

from ..config import SamplingConfig, UserError
from .contestants import Contestant, Outcome, Stepper, drained

HF_PEERS = ["hf-plain", "hf-lookup", "hf-assistant", "hf-early-exit"]
LLAMACPP_PEERS = ["llamacpp-plain", "llamacpp-lookup"]
PEERS = HF_PEERS + LLAMACPP_PEERS
LOOKUP_TOKENS = 10            # HF's and llama-cpp-python's documented default number of prompt-lookup tokens


def peer_contestants(names: list[str], stock, stock_draft, stop_ids: tuple[int, ...], gguf: str | None,
                     early_exit_layer: int | None, cfg: SamplingConfig | None = None
                     ) -> tuple[list[Contestant], dict[str, str]]:
    """Contestants for the peers among `names`; {peer: reason} for those that cannot run here (or cannot apply
    the sampling settings `cfg`)."""
    out, skipped = [], {}
    for name in names:
        try:
            if name in HF_PEERS and cfg is not None and cfg.penalizes_output:
                raise UserError("Hugging Face generate has no frequency / presence penalty")
            steps = None if name in HF_PEERS else _llamacpp(name, gguf, stop_ids)
            run = _hf(name, stock, stock_draft, stop_ids, early_exit_layer) if steps is None else drained(steps)
        except UserError as err:
            skipped[name] = str(err)
            continue
        out.append(Contestant(name, "peer", run, batched=False, steps=steps))
    return out, skipped


def _outcome(tokens: list[int], seconds: float, plain: bool) -> Outcome:
    """One row's answer, run alone: its time is both its own and its share. A plain peer gains one token per
    forward (accept_lengths all 1, as Spec-Bench records its baseline); the others do not say."""
    return Outcome(tokens, seconds, seconds, len(tokens) if plain else None, [1] * len(tokens) if plain else [])


def _row_by_row(one, plain: bool):
    """A batch runner from a one-prompt function (ids, cfg) -> (new ids, seconds)."""
    def run(prompts: list[list[int]], cfg: SamplingConfig) -> list[Outcome]:
        return [_outcome(*one(ids, cfg), plain) for ids in prompts]
    return run


def _hf_extra(name: str, model, tokenizer, stock_draft, early_exit_layer: int | None) -> dict:
    """generate's arguments for the peer: with a draft of another vocabulary, both tokenizers (transformers'
    universal assisted generation, which re-tokenizes the text between them)."""
    if name == "hf-plain":
        return {}
    if name == "hf-lookup":
        return {"prompt_lookup_num_tokens": LOOKUP_TOKENS}
    if name == "hf-assistant":
        if stock_draft is None:
            raise UserError("hf-assistant needs a draft model (--draft)")
        extra = {"assistant_model": stock_draft.model}
        if stock_draft.tokenizer.get_vocab() != tokenizer.get_vocab():     # universal assisted generation
            extra.update(tokenizer=tokenizer, assistant_tokenizer=stock_draft.tokenizer)
        return extra
    layers = model.config.num_hidden_layers
    layer = early_exit_layer or max(1, layers // 2)
    if not 0 < layer < layers:
        raise UserError(f"--hf-early-exit-layer must be in [1, {layers - 1}], got {layer}")
    return {"assistant_early_exit": layer}


@contextlib.contextmanager
def _assistant_rereads_its_last_token():
    """transformers 5.25's assisted generation across tokenizers crops the assistant's cache to the tokens the
    target's text re-encodes to; where they add none, the assistant is asked for a forward over zero new tokens and
    fails (a reshape error in its attention). While this is on, such a cache gives up its last token, which the
    assistant then reads again: the drafts transformers means, without the crash."""
    from transformers.generation import candidate_generator as generators
    cls = generators.AssistedCandidateGenerator
    original = cls._update_past_and_masks

    def update(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        cache = self.assistant_kwargs.get("cache")
        if cache is not None and cache.get_seq_length() >= input_ids.shape[-1]:
            cache.crop(-(cache.get_seq_length() - input_ids.shape[-1] + 1))
        return out
    cls._update_past_and_masks = update
    try:
        yield
    finally:
        cls._update_past_and_masks = original


def _hf(name: str, stock, stock_draft, stop_ids, early_exit_layer):
    """Hugging Face's own generate on an untouched copy of the model, whole answers only (module docstring)."""
    if stock is None:
        raise UserError(f"{name} needs the model as a transformers model")
    model, tok = stock.model, stock.tokenizer
    extra = _hf_extra(name, model, tok, stock_draft, early_exit_layer)
    stop = list(stop_ids) or None

    def one(ids, cfg: SamplingConfig):
        x = torch.tensor([ids], device=model.device)
        sampling = ({"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or None,
                     "top_p": cfg.top_p} if not cfg.greedy else {"do_sample": False})
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        across = "assistant_tokenizer" in extra
        with torch.inference_mode(), (_assistant_rereads_its_last_token() if across else contextlib.nullcontext()):
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                 eos_token_id=stop, pad_token_id=tok.pad_token_id or 0,
                                 repetition_penalty=cfg.repetition_penalty, **sampling, **extra)
            tokens = out[0, len(ids):].tolist()          # on a GPU: waits for the last kernels, inside the time
        return tokens, time.perf_counter() - t0
    return _row_by_row(one, name == "hf-plain")


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _llamacpp(name: str, gguf: str | None, stop_ids) -> Stepper:
    """llama-cpp-python on the same GGUF: `Llama.generate` over token ids, with `LlamaPromptLookupDecoding` as
    its draft model for llamacpp-lookup; taken a token at a time (`_llamacpp_steps`)."""
    if not llamacpp_available():
        raise UserError("the optional module llama_cpp is not installed (pip install llama-cpp-python)")
    if gguf is None:
        raise UserError("llama.cpp runs GGUF files only; this model is not one")
    from llama_cpp import Llama
    draft = None
    if name == "llamacpp-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    # every core, as spekit's torch uses (llama-cpp-python's default is half of them); with a draft model its scores
    # must be kept at every position, which llama-cpp-python sizes only when asked (else they overflow at 512)
    llm = Llama(model_path=gguf, n_ctx=4096, draft_model=draft, logits_all=draft is not None, verbose=False,
                n_threads=os.cpu_count() or 1)
    return _llamacpp_steps(llm, set(stop_ids) | {llm.token_eos()}, name == "llamacpp-plain")


def _llamacpp_steps(llm, stops: set[int], plain: bool) -> Stepper:
    """The rows of a batch answered one after another, a token per event (the contract of
    contestants.engine_steps: yields the tokens committed so far, returns one Outcome per prompt). A prompt that
    continues the last one and its answer (a conversation's next turn) keeps what the cache holds (reset=False),
    as spekit's llama.cpp backend does; any other starts afresh: `reset()` first, since llama-cpp-python's
    `generate` would otherwise keep the longest start it shares with the last prompt (a chat template's system
    prompt), which the bench takes from spekit's methods too (runner: drop_prefixes)."""
    last: list[int] = []

    def steps(prompts: list[list[int]], cfg: SamplingConfig):
        outs, committed = [], 0
        for ids in prompts:
            follows = bool(last) and ids[:len(last)] == last
            if not follows:
                llm.reset()
            tokens, seconds = yield from _answer(llm, ids, cfg, stops, not follows, committed)
            committed += len(tokens)
            last[:] = list(ids) + tokens
            outs.append(_outcome(tokens, seconds, plain))
        return outs
    return steps


def _answer(llm, ids: list[int], cfg: SamplingConfig, stops: set[int], reset: bool, before: int):
    """One prompt's answer through `Llama.generate`, a token per `next`: yields `before` plus the tokens so far;
    returns (new tokens, seconds). Only the work inside each `next` is timed (the prompt's prefill falls in the
    first), so that what runs between (other contestants' steps, in lockstep) does not count."""
    stream = llm.generate(ids, temp=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                          repeat_penalty=cfg.repetition_penalty, frequency_penalty=cfg.frequency_penalty,
                          presence_penalty=cfg.presence_penalty, reset=reset)
    tokens: list[int] = []
    seconds = 0.0
    while True:
        start = time.perf_counter()
        tok = next(stream, None)
        end = tok is None or tok in stops or len(tokens) + 1 >= cfg.max_new_tokens
        if end:
            stream.close()
        seconds += time.perf_counter() - start
        if tok is not None:
            tokens.append(tok)
            yield before + len(tokens)
        if end:
            return tokens, seconds


def gguf_path(source) -> str | None:
    """The GGUF file a model was loaded from, if any."""
    return str(Path(source.path) / source.gguf_file) if source.gguf_file else None
