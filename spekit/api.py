"""The Python API: text at the edges, the token engine inside.

    sk = Spekit.load("smollm2-135m", method="ngram")
    for g in sk.generate(["Summarize: ..."], SamplingConfig(max_new_tokens=64)):
        print(g.text, g.result.stats.tau)
    for piece in sk.stream("Tell me a story"):
        print(piece, end="")
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .backends.host_memory import settle
from .config import SamplingConfig, UserError
from .methods import AUTO, build_engine, resolve_method
from .grammar import Grammars
from .backends.torch_models import DTYPES, LoadedModel, ModelSource, load_model
from .proposers import get as get_method
from .stats import Result
from .backends.torch_target import Target
from .detokenize import MarkedStream, TextStream


@dataclass
class Generation:
    prompt: str
    text: str
    result: Result
    tokenizer: Any = None      # names the tokens of the log-probabilities in as_dict

    def as_dict(self, method: str) -> dict:
        out = {"prompt": self.prompt, "text": self.text, "method": method,
               "prompt_index": self.result.prompt_index, "sample": self.result.sample_index, **self.result.as_dict()}
        if "logprobs" in out and self.tokenizer is not None:
            for entry in out["logprobs"]:
                for item in [entry, *entry["top_logprobs"]]:
                    item["token"] = self.tokenizer.decode([item["token_id"]])
        return out


SHIPPED = Path(__file__).resolve().parent / "data" / "heads"


def _draft_target(draft, cuda_graphs: bool = True):
    """The proposer's draft target: a torch Target over a loaded draft model, or a backend's own draft target."""
    if draft is None or not isinstance(draft, LoadedModel):
        return draft
    out = Target(draft.model, cuda_graphs=cuda_graphs)
    out.tokenizer = draft.tokenizer          # for a draft of another vocabulary (proposers.cross_draft)
    return out


def shipped_draft(loaded: LoadedModel, target=None):
    """The draft model shipped for this model (spekit/data/heads/<name>/draft, trained with `spekit train
    draft`), on the target's device and dtype (on llama.cpp: written as a GGUF once and run there); None when
    none ships."""
    name = loaded.source.name
    if loaded.source.kind == "adapter":                # a fine-tune of a model: that model's draft (still lossless)
        from .backends.peft_adapters import base_of
        name = base_of(loaded.source.path)
    if "/" in name or "\\" in name:     # a path or hub id: no shipped draft by that name
        return None
    path = SHIPPED / name / "draft"
    if not (path / "config.json").is_file():
        return None
    if getattr(target, "backend", "torch") == "llama.cpp":
        from .backends.loading import load_llama_draft
        return load_llama_draft(str(path), target.settings, target)
    param = next(loaded.model.parameters())
    dtype = next(name for name, d in DTYPES.items() if d == param.dtype)
    return load_model(str(path), dtype=dtype, device=str(param.device))


def check_method(method: str) -> None:
    """An unknown method is a UserError; "auto" picks one at load (spekit.methods.auto_method)."""
    if method != AUTO:
        get_method(method)


class Spekit:
    def __init__(self, loaded: LoadedModel, method: str = "plain", draft=None,
                 options: dict | None = None, target=None, compile: bool = False,
                 cuda_graphs: bool = True, cost_profile: str = "auto", exact: bool = True):
        """draft: a LoadedModel (torch) or a draft target of the target's backend (a LlamaTarget); target: the
        target to run on (default: a torch Target over loaded.model). compile: run the target's forward through
        torch.compile; cuda_graphs: replay steps as CUDA graphs on CUDA; cost_profile: where the measured step
        costs are kept between runs, "auto", "none" or a file (see Target, spekit.pacing.profiles); exact: see Target
        (False only for plain decoding, such as distillation)."""
        self.tokenizer = loaded.tokenizer
        self.target = target or Target(loaded.model, compile=compile, cuda_graphs=cuda_graphs,
                                       cost_profile=cost_profile, exact=exact)
        method, self.auto_reason = resolve_method(method, self.target)     # why "auto" became self.method
        self.loaded, self.method, self.draft = loaded, method, draft
        if draft is None and get_method(method).needs_draft_model:
            draft = shipped_draft(loaded, self.target)
        stop_ids = self._stop_ids()
        self.engine = build_engine(self.target, method, options, _draft_target(draft, cuda_graphs),
                                   stop_ids=stop_ids, grammars=Grammars(self.tokenizer, self.target.vocab_size,
                                                                        stop_ids), tokenizer=self.tokenizer)
        settle()                         # the `spekit` command: what is loaded leaves the collector's full passes

    @classmethod
    def load(cls, model: str = "smollm2-135m", method: str = "plain", draft: str | None = None,
             dtype: str = "float32", device: str = "cpu", quantize: str = "none", compile: bool = False,
             *, backend: str = "torch", llama=None, cuda_graphs: bool = True, cost_profile: str = "auto",
             exact: bool = True, draft_backend: str = "same", **options) -> "Spekit":
        """quantize: the target's (and a draft model's) weights as "none", "int8" or "int4" (spekit.backends.weight_quant);
        compile: torch.compile the target's forward; cost_profile: see __init__. backend: "torch" (the default
        and the reference), "llama.cpp" (a GGUF file run by llama.cpp as it ships; `llama`: its
        backends.llama_cpp.LlamaSettings) or "auto" (backends.loading.choose); draft_backend: where the draft
        model runs, "same" (the target's), "torch" or "llama.cpp" (backends.loading.load_draft). Other keywords are
        the method's options."""
        check_method(method)  # fail on an unknown method before spending seconds on loading
        from .backends.loading import choose, load_draft
        if choose(backend, model, None if method == AUTO else get_method(method)) == "llama.cpp":
            return cls._on_llama(model, method, draft, llama, cost_profile, options, quantize, compile,
                                 draft_backend, dtype, device)
        loaded = load_model(model, dtype=dtype, device=device, quantize=quantize)
        draft_loaded = load_draft(draft, None, draft_backend, dtype, device, quantize) if draft else None
        return cls(loaded, method, draft_loaded, options, compile=compile, cuda_graphs=cuda_graphs,
                   cost_profile=cost_profile, exact=exact)

    @classmethod
    def _on_llama(cls, model, method, draft, settings, cost_profile, options, quantize, compile,
                  draft_backend="same", dtype="float32", device="cpu") -> "Spekit":
        from .backends.llama_model import LlamaSettings, refusal
        from .backends.loading import load_draft, load_llama
        if quantize != "none" or compile:
            raise UserError("--quantize and --compile belong to the torch backend; llama.cpp runs the GGUF file in "
                            "its own quantized types")
        settings = settings or LlamaSettings()
        if method != AUTO:        # a method llama.cpp cannot run: said before anything loads
            refused = refusal(get_method(method))
            if refused:
                raise UserError(refused)
        target, tokenizer, source = load_llama(model, settings, cost_profile)
        drafted = load_draft(draft, target, draft_backend, dtype, device) if draft else None
        return cls(LoadedModel(None, tokenizer, source), method, drafted, options, target=target)

    @classmethod
    def from_model(cls, model, tokenizer, method: str = "plain", draft_model=None, *, compile: bool = False,
                   cuda_graphs: bool = True, cost_profile: str = "auto", draft_tokenizer=None,
                   **options) -> "Spekit":
        """Over a causal LM the caller has loaded already (a transformers PreTrainedModel and its tokenizer, with
        its own dtype and device; a fine-tuned or merged model, say), and optionally a draft model of the same
        vocabulary, or of another with its `draft_tokenizer`. The models are put in eval mode and switched in place
        to spekit's forward forms (see Target): the same results in float32; in bfloat16 the row-invariant forms
        that keep verification exact.
        Heads shipped for a model of the same shapes are found as for a loaded one; others come with
        `heads=DIR`."""
        check_method(method)
        name = str(getattr(model.config, "_name_or_path", "") or "model")
        loaded = LoadedModel(model.eval(), tokenizer, ModelSource(name, name, None, "object"))
        draft = None if draft_model is None else LoadedModel(draft_model.eval(), draft_tokenizer or tokenizer,
                                                             ModelSource("draft", "draft", None, "object"))
        return cls(loaded, method, draft, options, compile=compile, cuda_graphs=cuda_graphs,
                   cost_profile=cost_profile)

    def with_method(self, method: str, draft: LoadedModel | None = None, target=None, **options) -> "Spekit":
        """Another method over the same loaded target weights (and the same target, or `target`: another over
        them, e.g. LlamaTarget.sibling)."""
        return Spekit(self.loaded, method, draft, options, target=target or self.target)

    def _stop_ids(self) -> tuple[int, ...]:
        ids = set(getattr(self.target, "stop_ids", ()))             # a GGUF's own end tokens (llama.cpp)
        config = getattr(self.loaded.model, "generation_config", None)
        for source in (self.tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return tuple(sorted(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; through the chat template when `chat` (default: when the model has one). A
        list of {"role", "content"} messages is a conversation, always through the chat template."""
        if isinstance(prompt, list):
            if not prompt:
                raise UserError("the conversation is empty")
            return self.encode_chat(prompt)
        if not prompt or not prompt.strip():
            raise UserError("the prompt is empty")
        chat = self.has_chat_template if chat is None else chat
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt).input_ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the chat template, ready for the assistant's turn; tools: the
        `tools` argument of templates that render them."""
        if not self.has_chat_template:
            raise UserError("this model has no chat template; use --raw")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: list[str], sampling: SamplingConfig | None = None,
                 chat: bool | None = None, stop: list[str] | None = None) -> list[Generation]:
        """stop: text stop sequences (as OpenAI's `stop`): a sample ends as soon as its text holds one (finish
        "stop"), and its text is cut before it; its tokens run to the one that completed it."""
        sampling = sampling or SamplingConfig()
        ids = [self.encode(p, chat) for p in prompts]
        results = self.engine.generate(ids, sampling, self._until(stop))
        return [Generation(prompts[r.prompt_index], self._text(r.token_ids, stop), r, self.tokenizer)
                for r in results]

    def stream(self, prompt: str | list[dict], sampling: SamplingConfig | None = None, chat: bool | None = None,
               stop: list[str] | None = None) -> Iterator[str]:
        """Text pieces of one sample (of a prompt, or the next turn of a conversation: see `encode`) as they are
        committed (never half a character, and with `stop` never the start of a stop sequence before it is known
        not to be one). The finished Result is then `self.last_result`."""
        for piece, _ in self.stream_marked(prompt, sampling, chat, stop):
            yield piece

    def stream_marked(self, prompt: str | list[dict], sampling: SamplingConfig | None = None,
                      chat: bool | None = None, stop: list[str] | None = None) -> Iterator[tuple[str, bool]]:
        """`stream`'s pieces as (text, drafted): drafted when its tokens came from accepted drafts, not from the
        target's own step (what `--show-drafts` colours)."""
        sampling = dataclasses.replace(sampling or SamplingConfig(), n=1)
        ids = self.encode(prompt, chat)
        text = MarkedStream(self.tokenizer, stop or [])
        for event in self.engine.stream([ids], sampling, self._until(stop)):
            if event.result is not None:
                self.last_result = event.result
            yield from text.feed(event.tokens, event.drafted, final=event.finish is not None)

    def _until(self, stop: list[str] | None):
        """The engine's per-row test for text stop sequences (Engine.generate's `until`), or None."""
        if not any(stop or []):
            return None
        texts: dict[int, TextStream] = {}

        def until(row: int, tokens: list[int]) -> bool:
            text = texts.setdefault(row, TextStream(self.tokenizer, stop))
            text.feed(tokens, final=False)
            return text.stopped
        return until

    def _text(self, ids: list[int], stop: list[str] | None) -> str:
        """The text of `ids`, cut before the first stop sequence it holds."""
        text = self.decode(ids)
        hits = [text.find(s) for s in stop or [] if s and s in text]
        return text[:min(hits)] if hits else text
