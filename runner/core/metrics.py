"""Prometheus metrics of one engine: queue, running requests, latencies, token throughput.

Each server owns its registry (no process-global state), exported at /metrics, where the series vLLM also has are
repeated under vLLM's names (`vllm:num_requests_running`, ... with its `model_name` label), so dashboards and
autoscalers written for vLLM read this server as they are."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from runner.speculative.drafts import SpeculationStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_THROUGHPUT_WINDOW_S = 10.0


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("engine_requests_waiting", "Requests queued for a cache row", registry=r)
        self.running = Gauge("engine_requests_running", "Requests holding a cache row", registry=r)
        self.ttft = Histogram(
            "engine_time_to_first_token_seconds", "Submission to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "engine_inter_token_latency_seconds",
            "Between two tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.prefix_cache_hits = Counter(
            "engine_prefix_cache_hit_tokens", "Prompt tokens whose K/V came from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("engine_generation_tokens", "Tokens generated", registry=r)
        self.rejected = Counter("engine_requests_rejected", "Requests refused because the queue was full", registry=r)
        self.request_latency = Histogram(
            "engine_request_latency_seconds",
            "Submission to the last token of a request that ended by itself (stop or length)",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "engine_requests_finished",
            "Requests that ended, by finish_reason (stop, length, abort: cancelled, disconnected or failed)",
            ["finish_reason"],
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "engine_generation_tokens_per_second",
            f"Generated tokens/s over the last {_THROUGHPUT_WINDOW_S:.0f} s",
            registry=r,
        )
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def track_cache(self, resident_bytes) -> None:
        """The KV cache's memory (its resident pages), read at scrape time."""
        Gauge(
            "engine_kv_cache_resident_bytes",
            "Memory the KV cache holds (pages rows have written)",
            registry=self.registry,
        ).set_function(resident_bytes)

    def track_speculation(self, stats: SpeculationStats) -> None:
        """A speculative engine's acceptance and draft/verify time, read from its counters at scrape time."""
        r = self.registry
        for name, doc, read in (
            ("engine_speculative_verify_steps", "Rows verified (one per request and step)", lambda: stats.verify_steps),
            (
                "engine_speculative_tokens_per_step",
                "Mean tokens emitted per verify step (accepted drafts + 1)",
                lambda: stats.mean_accepted,
            ),
            ("engine_speculative_draft_seconds", "Seconds spent in the draft graph", lambda: stats.draft_seconds),
            ("engine_speculative_verify_seconds", "Seconds spent in verify graph calls", lambda: stats.verify_seconds),
            (
                "engine_speculative_plain_rows",
                "Rows decoded without drafts (steps the speculation policy ran plain)",
                lambda: stats.plain_rows,
            ),
        ):
            Gauge(name, doc, registry=r).set_function(read)

    def observe_step(self, waiting: int, running: int, tokens: int, now: float) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.generation_tokens.inc(tokens)
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else _THROUGHPUT_WINDOW_S
        self.tokens_per_second.set(sum(t for _, t in self._recent) / span)

    def request_finished(self, finish_reason: str, seconds: float | None) -> None:
        """`seconds`: submission to the end (None for an abort: its length says nothing of the engine)."""
        self.finished.labels(finish_reason=finish_reason).inc()
        if seconds is not None:
            self.request_latency.observe(seconds)

    def render(self, model_name: str) -> bytes:
        """The text exposition: our series, then the same ones under vLLM's names."""
        vllm = CollectorRegistry()
        vllm.register(_VllmNames(self.registry, model_name))
        return generate_latest(self.registry) + generate_latest(vllm)


# our metric -> vLLM's name for the same series (vLLM v1's, as its Grafana dashboard reads them)
VLLM_NAMES = {
    "engine_requests_running": "vllm:num_requests_running",
    "engine_requests_waiting": "vllm:num_requests_waiting",
    "engine_prompt_tokens": "vllm:prompt_tokens",
    "engine_generation_tokens": "vllm:generation_tokens",
    "engine_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
    "engine_requests_finished": "vllm:request_success",
    "engine_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "engine_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "engine_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


class _VllmNames:
    """A collector that reads `source` at scrape time and yields the VLLM_NAMES series renamed, labelled with
    model_name (and vLLM's `finished_reason` for our `finish_reason`)."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source, self.model_name = source, model_name

    def collect(self):
        for family in self.source.collect():
            name = VLLM_NAMES.get(family.name)
            if name is None:
                continue
            renamed = Metric(name, family.documentation, family.type)
            for sample in family.samples:
                labels = {("finished_reason" if k == "finish_reason" else k): v for k, v in sample.labels.items()}
                renamed.add_sample(
                    name + sample.name[len(family.name) :],
                    {**labels, "model_name": self.model_name},
                    sample.value,
                    sample.timestamp,
                )
            yield renamed
