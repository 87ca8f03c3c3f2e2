"""One benchmark run: every contestant on the same questions (all turns; the second turn sees the contestant's own
first answer), batch by batch and contestant after contestant so that slow drifts of the machine hit all alike;
answers go to the answers folder as they are made (resumable), and the report is computed from that folder."""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import SamplingConfig, UserError
from . import answers
from .contestants import Contestant, spekit_contestants, split_names
from .divergence import divergences
from .lockstep import lockstep
from .peers import PEERS, gguf_path, peer_contestants
from .questions import encode_turn
from .summary import summarize


@dataclass(frozen=True)
class Settings:
    """What a run measures under. Sweeps vary one field (or one method option) at a time."""
    model: str = "smollm2-135m"
    draft: str | None = None
    draft_backend: str = "same"                      # where the draft runs: same (the target's), torch, llama.cpp
    dtype: str = "float32"
    device: str = "cpu"
    quantize: str = "none"                           # spekit's target weights (the HF peers keep full weights)
    compile: bool = False
    cuda_graphs: bool = True                         # on CUDA: steps replayed as CUDA graphs (spekit.backends.cuda_graphs)
    cost_profile: str = "auto"                       # step costs kept between runs (spekit.pacing.profiles)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0                   # OpenAI's penalties (the HF peers have none: skipped)
    presence_penalty: float = 0.0
    seed: int = 0
    verification: str = "block"                      # chains of sampled drafts: block or token (spekit.acceptance)
    relaxed: float = 0.0                             # LOSSY tolerance in nats (SamplingConfig.relaxed; 0: exact)
    batch: int = 1
    options: dict = field(default_factory=dict)      # method options, by field name (all methods share names)
    early_exit_layer: int | None = None              # hf-early-exit's exit layer (default: half the layers)
    chat: bool | None = None                         # chat template (default: when the model has one)
    lockstep: bool = False                           # spekit methods step by step in turn per batch (lockstep.py)
    backend: str = "torch"                           # the spekit methods' target: torch or llama.cpp (or auto)
    ctx_size: int = 4096                             # llama.cpp: cache cells per row
    threads: int = 0                                 # llama.cpp: CPU threads (0: every core this process may use)
    kernels: str = "exact"                           # llama.cpp: exact or fast (backends.llama_cpp.LlamaSettings)
    prefill: str = "fast"                            # llama.cpp: the kernels of prompts, fast or exact (the same)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              max_new_tokens=self.max_new_tokens, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              verification=self.verification, relaxed=self.relaxed)

    def with_value(self, key: str, value) -> "Settings":
        if key in {f.name for f in dataclasses.fields(self)}:
            return dataclasses.replace(self, **{key: value})
        return dataclasses.replace(self, options={**self.options, key: value})


_LOADED: dict = {}


def _load(name: str, dtype: str, device: str, stock: bool, quantize: str = "none"):
    """A model loaded once per process; `stock` copies stay untouched for the peers (spekit's Target switches
    its model's linear layers to faster forms)."""
    from ..backends.torch_models import load_model
    key = (name, dtype, device, stock, quantize)
    if key not in _LOADED:
        _LOADED[key] = load_model(name, dtype, device, quantize)
    return _LOADED[key]


def _base(s: Settings):
    """The plain Spekit the run's methods share their target with (torch; on llama.cpp its weights, each method in
    lockstep on a context of its own: `own_contexts`)."""
    from ..api import Spekit
    from ..backends.loading import choose
    if choose(s.backend, s.model) == "llama.cpp":
        from ..backends.llama_model import LlamaSettings
        llama = LlamaSettings(ctx_size=s.ctx_size, parallel=s.batch, threads=s.threads, kernels=s.kernels,
                              prefill=s.prefill)
        return Spekit.load(s.model, backend="llama.cpp", llama=llama, cost_profile=s.cost_profile,
                           quantize=s.quantize, compile=s.compile)
    return Spekit(_load(s.model, s.dtype, s.device, False, s.quantize), compile=s.compile, cuda_graphs=s.cuda_graphs,
                  cost_profile=s.cost_profile)


def own_contexts(s: Settings, base) -> bool:
    """Whether each method gets a llama.cpp context of its own (lockstep on llama.cpp; `spekit_contestants`)."""
    return s.lockstep and hasattr(base.target, "sibling")


def prepare(s: Settings, names: list[str] | None) -> tuple[list[Contestant], dict[str, str], object]:
    """(contestants, skipped {name: reason}, the plain Spekit) for these settings."""
    methods, peers = split_names(names, PEERS)
    base = _base(s)
    layers, exit_layer = base.target.num_layers, s.early_exit_layer
    if "hf-early-exit" in peers and exit_layer is not None and not 0 < exit_layer < layers:
        raise UserError(f"--hf-early-exit-layer must be in [1, {layers - 1}] for this model, got {exit_layer}")
    draft = _draft(s, base) if s.draft else None
    contestants, skipped = spekit_contestants(base, draft, methods, s.options, s.sampling(), own_contexts(s, base))
    if peers:
        hf = [p for p in peers if p.startswith("hf-")]
        stock = _load(s.model, s.dtype, s.device, True) if hf else None
        stock_draft = _load(s.draft, s.dtype, s.device, True) if s.draft and "hf-assistant" in peers else None
        more, why = peer_contestants(peers, stock, stock_draft, base.engine.stop_ids, gguf_path(base.loaded.source),
                                     s.early_exit_layer, s.sampling())
        contestants += more
        skipped.update(why)
    return contestants, skipped, base


def _draft(s: Settings, base):
    """The --draft model on --draft-backend (by default the base's)."""
    from ..backends.loading import load_draft
    return load_draft(s.draft, base.target, s.draft_backend, s.dtype, s.device, s.quantize,
                      loader=lambda name, dtype, device, quantize: _load(name, dtype, device, False, quantize))


def measure(s: Settings, questions: list[dict], names: list[str] | None, folder: str | Path | None,
            desc: str = "bench") -> dict:
    """Run (or resume) the benchmark; returns the report (summary.py) of everything in the answers folder."""
    if s.batch < 1:
        raise UserError(f"batch must be >= 1, got {s.batch}")
    contestants, skipped, base = prepare(s, names)
    with tempfile.TemporaryDirectory(prefix="spekit-bench-") as tmp:
        out = Path(folder) if folder else Path(tmp)
        # where the step costs are kept changes no answer: a folder resumes whatever --cost-profile says, but flat
        # costs change every drafter's trees (and so its τ and time), so a flat run is a setting of its own
        answers.claim(out, {k: v for k, v in _meta(s).items() if k != "cost_profile" or v == "flat"})
        chat = base.has_chat_template if s.chat is None else s.chat
        skipped.update(_run_all(contestants, questions, s, out, base, chat, desc))
        contestants = [c for c in contestants if c.name not in skipped]
        records = {c.name: answers.read(out, c.name) for c in contestants}
    report = summarize(records, contestants, skipped, s.max_new_tokens, intervals=s.batch == 1)
    report["settings"] = _meta(s)
    report["backend"] = _backend_meta(base)
    lossless = [c.name for c in contestants if c.kind == "spekit" and c.lossless and c.name != "plain"]
    report["divergences"] = divergences(base, questions, records, lossless, chat, s.sampling())
    return report


def _backend_meta(base) -> dict:
    """What computed the spekit methods' logits: the backend, and on llama.cpp its settings, version and whether
    its wide forwards round as one-token ones (backends.llama_lib.rounding_apart)."""
    target = base.target
    if getattr(target, "backend", "torch") != "llama.cpp":
        return {"name": "torch"}
    from ..backends.llama_lib import rounding_apart, version
    return {"name": "llama.cpp", "llama_cpp_python": version(), "settings": dataclasses.asdict(target.settings),
            "rounding_apart": rounding_apart() + ([] if target.settings.exact else ["--kernels fast"])}


def _meta(s: Settings) -> dict:
    meta = dataclasses.asdict(s)
    meta["options"] = dict(sorted(s.options.items()))
    return meta


def _warm_up(c: Contestant, ids: list[int], s: Settings) -> str | None:
    """Run a contestant once at the batch size (first forwards and cost calibration are slow). Returns why it
    cannot run here, or None: a method's UserError (raised where it starts decoding), or any error of a peer."""
    try:
        c.run([ids] * s.batch, dataclasses.replace(s.sampling(), max_new_tokens=8))
        if c.kind == "spekit":
            c.loaded.engine.proposer.forget()    # the warm-up answered the first question: not a text to draft from
    except UserError as err:
        return str(err)
    except Exception as err:                      # a peer's library refusing this model: skip, do not stop
        if c.kind != "peer":
            raise
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def _run_all(contestants, questions, s: Settings, out: Path, base, chat: bool, desc: str) -> dict[str, str]:
    """Answer what is not answered yet; returns {name: reason} for contestants that failed to start, and for peers
    that failed mid-run (the rest of their group answers on without them)."""
    cfg = s.sampling()
    batches = [questions[i: i + s.batch] for i in range(0, len(questions), s.batch)]
    todo = {c.name: answers.done_ids(out, c.name) for c in contestants}
    work = sum(1 for b in batches for c in contestants for q in b if q["question_id"] not in todo[c.name])
    failed: dict[str, str] = {}
    if not work:
        return failed
    warm = encode_turn(base.tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}], chat)
    with tqdm(total=work, desc=desc, unit="answer", file=sys.stderr, leave=False) as bar:
        for c in contestants:
            bar.set_postfix_str(f"warm-up {c.name}")
            why = _warm_up(c, warm, s)
            if why:
                failed[c.name] = why
        contestants = [c for c in contestants if c.name not in failed]
        for k, batch in enumerate(batches):
            going = [c for c in contestants if c.name not in failed]         # a peer may fail mid-run
            for group in _groups(going, batch, todo, s.lockstep):
                group = group[k % len(group):] + group[: k % len(group)]     # lockstep: each leads in turn
                bar.set_postfix_str(" + ".join(c.name for c in group) if len(group) < 4 else "lockstep")
                left = [q for q in batch if q["question_id"] not in todo[group[0].name]]
                # each group starts without what earlier ones left in the cache: a prefix kept from another
                # method's answer to the same question would spare this one the prompt (the llama.cpp backend)
                getattr(base.target, "drop_prefixes", lambda: None)()
                recs, errors = converse_all(group, left, base, cfg, chat, Path(s.model).name)
                for name, err in errors.items():      # a peer's own library failing mid-run: report it, go on
                    failed[name] = f"failed mid-run: {type(err).__name__}: {str(err)[:200]}"
                for name, rec in recs.items():
                    answers.append(out, name, rec)
                bar.update(len(left) * len(group))
    return failed


def _groups(contestants: list[Contestant], batch: list[dict], todo: dict, together: bool) -> list[list[Contestant]]:
    """The contestants that still have questions of this batch to answer, as groups run at once: with `together`,
    one group of the steppable contestants that have none of it answered yet (lockstep), then one per other."""
    ids = {q["question_id"] for q in batch}
    waiting = [c for c in contestants if ids - todo[c.name]]
    joint = [c for c in waiting if together and c.steps is not None and not ids & todo[c.name]]
    joint = joint if len(joint) > 1 else []
    return ([joint] if joint else []) + [[c] for c in waiting if c not in joint]


def converse(c: Contestant, questions: list[dict], base, cfg: SamplingConfig, chat: bool, model_id: str) -> list[dict]:
    """All turns of these questions through one contestant, the batch together turn by turn."""
    recs, errors = converse_all([c], questions, base, cfg, chat, model_id)
    if errors:
        raise errors[c.name]
    return recs[c.name]


def converse_all(group: list[Contestant], questions: list[dict], base, cfg: SamplingConfig, chat: bool,
                 model_id: str) -> tuple[dict[str, list[dict]], dict[str, Exception]]:
    """All turns of these questions through each contestant of the group (several: in lockstep, each over its own
    history, the second turn seeing its own first answer). Returns ({name: answer records}, {peer: its error}): a
    peer whose library fails leaves the group, and the others answer on; any other error is raised."""
    history = {c.name: [[] for _ in questions] for c in group}
    outs = {c.name: [[] for _ in questions] for c in group}
    errors: dict[str, Exception] = {}
    for t in range(max(len(q["turns"]) for q in questions)):
        if not group:
            break
        rows = [i for i, q in enumerate(questions) if t < len(q["turns"])]
        prompts = {}
        for c in group:
            for i in rows:
                history[c.name][i].append({"role": "user", "content": questions[i]["turns"][t]})
            prompts[c.name] = [encode_turn(base.tokenizer, history[c.name][i], chat) for i in rows]
        got = _turn(group, prompts, base, cfg)
        errors.update((name, o) for name, o in got.items() if isinstance(o, Exception))
        group = [c for c in group if c.name not in errors]
        for c in group:
            for i, o in zip(rows, got[c.name]):
                history[c.name][i].append({"role": "assistant", "content": base.decode(o.token_ids)})
                outs[c.name][i].append(o)
    recs = {c.name: [answers.record(q, model_id, c.name, [m["content"] for m in h if m["role"] == "assistant"], o)
                     for q, h, o in zip(questions, history[c.name], outs[c.name])] for c in group}
    return recs, errors


def _turn(group: list[Contestant], prompts: dict[str, list[list[int]]], base, cfg: SamplingConfig) -> dict:
    """One turn of each contestant of the group over its own prompts: {name: its outcomes, or for a peer its
    error}. Several go in lockstep, the same prompts prefilled once and each method charged that prefill's time
    (Target.prefilled); a peer computes its own (its own library), and its failure ends only its own run."""
    with torch.inference_mode():
        if len(group) == 1:
            c = group[0]
            try:
                return {c.name: c.run(prompts[c.name], cfg)}
            except Exception as err:
                if c.kind != "peer":
                    raise
                return {c.name: err}
        # one prefill for every method of one target; on llama.cpp each method has a context of its own, and its own
        shared = contextlib.nullcontext() if hasattr(base.target, "sibling") else base.target.sharing_prefills()
        with shared:
            return lockstep({c.name: _caught(c.steps(prompts[c.name], cfg)) if c.kind == "peer"
                             else c.steps(prompts[c.name], cfg) for c in group})


def _caught(run):
    """A Stepper's run whose error is its result instead of being raised (a peer's, so that in lockstep the
    others go on without it)."""
    try:
        return (yield from run)
    except Exception as err:
        return err
