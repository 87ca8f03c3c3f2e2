"""Counters and histograms in the Prometheus text format (0.0.4), thread-safe, no dependency."""
from __future__ import annotations

import threading
from collections import defaultdict

from ..stats import SequenceStats

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

HELP = {
    "spekit_http_requests_total": ("counter", "HTTP requests by endpoint and status code"),
    "spekit_requests_total": ("counter", "generation requests accepted, by method"),
    "spekit_sequences_total": ("counter", "generated sequences (choices) by method and finish reason"),
    "spekit_prompt_tokens_total": ("counter", "prompt tokens of finished sequences"),
    "spekit_generated_tokens_total": ("counter", "tokens generated"),
    "spekit_target_forwards_total": ("counter", "target forwards (prefill + verification steps) per sequence"),
    "spekit_drafts_total": ("counter", "verification steps that checked a draft"),
    "spekit_draft_tokens_total": ("counter", "draft tokens offered (along the verified depth)"),
    "spekit_accepted_tokens_total": ("counter", "draft tokens accepted"),
    "spekit_tau": ("histogram", "tokens per target forward of finished sequences"),
    "spekit_time_to_first_token_seconds": ("histogram", "request arrival to first token"),
    "spekit_request_duration_seconds": ("histogram", "request arrival to last token"),
    "spekit_step_batch_size": ("histogram", "rows verified together per decoding step"),
    "spekit_running_rows": ("gauge", "sequences in the running batches"),
    "spekit_waiting_requests": ("gauge", "requests waiting for a batch slot"),
}


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, dict[tuple, float]] = defaultdict(dict)
        self.hists: dict[str, dict[tuple, list[float]]] = defaultdict(dict)   # bucket counts + [sum, count]
        self.gauges: dict[str, callable] = {}

    def inc(self, name: str, amount: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self.lock:
            self.values[name][key] = self.values[name].get(key, 0.0) + amount

    def observe(self, name: str, value: float, buckets=SECONDS_BUCKETS, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self.lock:
            h = self.hists[name].setdefault(key, [0.0] * (len(buckets) + 2))
            for i, edge in enumerate(buckets):
                if value <= edge:
                    h[i] += 1
            h[-2] += value
            h[-1] += 1

    def sequence(self, method: str, prompt_tokens: int, stats: SequenceStats, finish: str) -> None:
        """A finished (or cancelled) sequence."""
        self.inc("spekit_sequences_total", method=method, finish_reason=finish)
        self.inc("spekit_prompt_tokens_total", prompt_tokens, method=method)
        self.inc("spekit_generated_tokens_total", stats.new_tokens, method=method)
        self.inc("spekit_target_forwards_total", stats.target_forwards, method=method)
        self.inc("spekit_drafts_total", stats.position_offered[0] if stats.position_offered else 0, method=method)
        self.inc("spekit_draft_tokens_total", sum(stats.position_offered), method=method)
        self.inc("spekit_accepted_tokens_total", sum(stats.position_accepted), method=method)
        if stats.target_forwards:
            self.observe("spekit_tau", stats.tau, TAU_BUCKETS, method=method)

    def render(self) -> str:
        lines = []
        with self.lock:
            for name, (kind, text) in HELP.items():
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                if kind == "counter":
                    for key, v in sorted(self.values.get(name, {}).items()):
                        lines.append(f"{name}{_labels(dict(key))} {v:g}")
                elif kind == "gauge" and name in self.gauges:
                    lines.append(f"{name} {self.gauges[name]():g}")
                elif kind == "histogram":
                    buckets = {"spekit_tau": TAU_BUCKETS, "spekit_step_batch_size": BATCH_BUCKETS}.get(
                        name, SECONDS_BUCKETS)
                    for key, h in sorted(self.hists.get(name, {}).items()):
                        labels = dict(key)
                        for edge, count in zip(buckets, h):
                            lines.append(f"{name}_bucket{_labels({**labels, 'le': f'{edge:g}'})} {count:g}")
                        lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {h[-1]:g}")
                        lines.append(f"{name}_sum{_labels(labels)} {h[-2]:g}")
                        lines.append(f"{name}_count{_labels(labels)} {h[-1]:g}")
        return "\n".join(lines) + "\n"
