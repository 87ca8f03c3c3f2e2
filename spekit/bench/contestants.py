"""What a benchmark measures: every spekit method in the registry that can run on the model (those that cannot
are listed as skipped, with the reason their constructor gave), and the peers (peers.py). A contestant turns a
batch of prompts (token ids) into one Outcome per prompt."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator

from ..config import SamplingConfig, UserError
from ..proposers import REGISTRY
from . import variants


@dataclass
class Outcome:
    """One generated answer turn. Fields a peer cannot measure stay None / empty."""
    token_ids: list[int]
    wall_s: float                         # this row's own time (Spec-Bench's wall_time)
    charged_s: float                      # its share of the batch's time (batch wall / rows): throughput basis
    forwards: int | None = None           # target forwards (tau = tokens / forwards)
    accept_lengths: list[int] = field(default_factory=list)
    draft_s: float | None = None
    verify_s: float | None = None
    offered: list[int] = field(default_factory=list)     # per draft position: times offered
    accepted: list[int] = field(default_factory=list)    # per draft position: times accepted
    recording_s: float | None = None      # of draft_s + verify_s: recording CUDA graphs


Runner = Callable[[list[list[int]], SamplingConfig], list[Outcome]]
# a run taken one step at a time: yields the tokens committed so far, returns the outcomes (see lockstep.py)
Stepper = Callable[[list[list[int]], SamplingConfig], Generator[int, None, list[Outcome]]]


@dataclass
class Contestant:
    name: str
    kind: str                      # "spekit" or "peer"
    run: Runner
    lossless: bool = True
    counterpart: str | None = None  # the peer doing the same thing (for "x over its HF counterpart")
    batched: bool = True           # runs a batch in one call (peers run row by row)
    loaded: object = None          # the Spekit object (spekit methods), for memory accounting
    steps: Stepper | None = None   # the same run step by step (spekit methods, llama.cpp's peers)


COUNTERPARTS = {"plain": "hf-plain", "ngram": "hf-lookup", "draft": "hf-assistant", "early_exit": "hf-early-exit",
                "early-exit": "hf-early-exit", "layer_skip": "hf-early-exit", "layer-skip": "hf-early-exit"}
# on the llama.cpp backend the peer doing the same thing is llama.cpp's own (llama-cpp-python's generate, its
# prompt-lookup drafter)
LLAMACPP_COUNTERPARTS = {"plain": "llamacpp-plain", "ngram": "llamacpp-lookup"}


def options_for(name: str, options: dict) -> dict:
    """The given method options this method (or method variant, variants.py) takes: the others belong to other
    methods; a variant's own values over them."""
    return variants.options(name, options)


def spekit_contestants(base, draft, names: list[str], options: dict, cfg: SamplingConfig | None = None,
                       own_contexts: bool = False) -> tuple[list[Contestant], dict[str, str]]:
    """Contestants for the spekit methods among `names`, over `base` (a plain Spekit); and {method: reason} for
    those that cannot run here (their UserError, e.g. no draft model or no heads for this model). cfg: the run's
    settings (default: SamplingConfig()), which say whether a method's outputs are lossless (Proposer.keeps_law).
    own_contexts: each method on a llama.cpp context of its own over the same weights (lockstep: a context that
    methods take turns on rebuilds its compute graph at every switch, a cost no user's run has)."""
    cfg = cfg or SamplingConfig()
    out, skipped = [], {}
    for name in names:
        method = variants.method_of(name)
        cls = REGISTRY[method]
        try:
            if method == "plain" and not options_for(name, options) and not own_contexts:
                sk = base
            else:
                target = base.target.sibling() if own_contexts else None
                sk = base.with_method(method, draft if cls.needs_draft_model else None, target,
                                      **options_for(name, options))
        except UserError as err:
            skipped[name] = str(err)
            continue
        steps = engine_steps(sk.engine)
        peers = LLAMACPP_COUNTERPARTS if getattr(base.target, "backend", "torch") == "llama.cpp" else COUNTERPARTS
        out.append(Contestant(name, "spekit", drained(steps), sk.engine.proposer.keeps_law(cfg),
                              peers.get(method), loaded=sk, steps=steps))
    return out, skipped


def engine_steps(engine) -> Stepper:
    def steps(prompts: list[list[int]], cfg: SamplingConfig) -> Generator[int, None, list[Outcome]]:
        """The engine's stream, one event at a time. Times only the engine's own work (inside its events), so
        that other contestants' steps run in between (lockstep.py) do not count: a row's wall_s is the engine's
        time until the row's last token, charged_s its share of the whole batch's."""
        own, committed, done = 0.0, 0, []
        stream = engine.stream(prompts, cfg)
        while True:
            start = time.perf_counter()
            event = next(stream, None)
            own += time.perf_counter() - start + engine.target.take_credit()   # a shared prefill costs its time
            if event is None:
                break
            committed += len(event.tokens)
            if event.result is not None:
                done.append((event.result, own))
            yield committed
        done.sort(key=lambda d: (d[0].prompt_index, d[0].sample_index))
        share = own / len(done)
        return [Outcome(r.token_ids, wall, share, r.stats.target_forwards, list(r.stats.accept_lengths),
                        r.stats.draft_s, r.stats.verify_s, list(r.stats.position_offered),
                        list(r.stats.position_accepted), r.stats.recording_s) for r, wall in done]
    return steps


def drained(steps: Stepper) -> Runner:
    """The whole run of a Stepper in one call (what runs when no other contestant steps in between)."""
    def run(prompts: list[list[int]], cfg: SamplingConfig) -> list[Outcome]:
        gen = steps(prompts, cfg)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value
    return run


def split_names(requested: list[str] | None, peer_names: list[str]) -> tuple[list[str], list[str]]:
    """(spekit methods, peers) to run: all of both by default; plain always first. Unknown names are an error."""
    if not requested:
        return ["plain"] + sorted(n for n in REGISTRY if n != "plain"), list(peer_names)
    unknown = [n for n in requested if variants.method_of(n) not in REGISTRY and n not in peer_names]
    if unknown:
        raise UserError(f"unknown method or peer {', '.join(unknown)}; spekit methods: {', '.join(sorted(REGISTRY))};"
                        f" peers: {', '.join(peer_names)}; a method with options of its own: {variants.HOW}")
    methods = [n for n in requested if variants.method_of(n) in REGISTRY]
    for name in methods:
        variants.parse(name)                      # a bad variant is refused here, before a model loads
    return ["plain"] + [m for m in methods if m != "plain"], [n for n in requested if n in peer_names]
