"""Lockstep timing (`spekit bench --lockstep`): the spekit methods answer the same batch of questions step by step in
turn, the one with the fewest tokens committed going next, so that all of them pass each stretch of their answers
at about the same moment. A shared machine's speed moves by a quarter from one second to the next (measured here:
the same 48-token answer took 2.4-3.9 s in 25 runs); run one after another, each method meets other seconds than
plain does, and a cell of three answers moves by +-10%. In lockstep a slow stretch slows every method's same
tokens alike, and their ratios keep. Each method's time is its own steps' time only (contestants.py).

llama.cpp's peers step too (peers.py: llama-cpp-python's `generate` yields a token at a time), so that the ratio
"method / llama.cpp plain" is taken over the same seconds: they join the group, each answering the batch's rows
one after another inside its own run (a token per event, its progress counted as the tokens of all its rows, as a
method's), timed on its own steps and charged its own prefill (its own library and cache; the shared prefill below
serves spekit's methods only). A peer whose library fails mid-run leaves the group and the others go on (runner:
converse_all). The Hugging Face peers, whose `generate` answers whole, still run one after another after the group.

The run named first prefills first, and a prefill with the others' caches already alive was measured slower
(16 rows of 364-1487-token prompts, float32: 20-25%, and 7% once `spekit.backends.host_memory` keeps freed memory): with
`plain` always first, that alone put every method below plain at 16 rows. The prefill is the same computation for
every spekit method, so the bench computes it once per batch and charges each method its time
(`Target.sharing_prefills`: one prefill for all of them, its hidden states kept for the methods that read them),
and lets each contestant lead in turn, batch by batch (runner.py), a llama.cpp peer in the group among them (its
cache is allocated whole when it loads, not per batch; it leads only so that no method leads every batch).

On llama.cpp each method runs on a context of its own over the same weights (`LlamaTarget.sibling`) and computes
its own prefill: methods taking turns on one context made it rebuild its compute graph at every switch, a cost
that one method's run never has and which put every method several percent behind llama.cpp's peers in lockstep
(docs/LLAMACPP.md, "Results")."""
from __future__ import annotations

from typing import Generator

from .contestants import Outcome


def lockstep(runs: dict[str, Generator[int, None, list[Outcome]]]) -> dict[str, list[Outcome]]:
    """Advance the least advanced run (tokens committed; the first named on ties) one event at a time until all
    have returned. runs: {name: a Stepper's generator}. Returns {name: its outcomes}."""
    progress = {name: 0 for name in runs}
    live = dict(runs)
    out: dict[str, list[Outcome]] = {}
    while live:
        name = min(live, key=progress.__getitem__)
        try:
            progress[name] = next(live[name])
        except StopIteration as stop:
            out[name] = stop.value
            del live[name]
    return {name: out[name] for name in runs}
