"""Prometheus metrics, named after vLLM's with a `ferrox:` prefix.

Engine-side figures (queue sizes, KV usage, prefix hits, token totals) come
from the latest stats the engine process sent; request latencies are
observed in the frontend as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ferrox.engine.protocol import EngineStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_FRONTEND_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self.stats = stats
        self.model = model

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"ferrox:{name}", doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"ferrox:{name}", doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        total = max(s.num_total_blocks, 1)
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
            s.num_used_blocks / total,
        )
        yield gauge("kv_cache_total_blocks", "KV blocks in the pool.", s.num_total_blocks)
        yield gauge("kv_cache_used_blocks", "KV blocks held by requests.", s.num_used_blocks)
        yield gauge(
            "kv_cache_cached_blocks",
            "KV blocks held only by the prefix cache.",
            s.num_cached_blocks,
        )
        free = s.num_total_blocks - s.num_used_blocks - s.num_cached_blocks
        yield gauge("kv_cache_free_blocks", "KV blocks free in the pool.", free)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_queried_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens
        )
        yield counter(
            "num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions
        )
        yield counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)


class Metrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(stats, model))  # type: ignore[arg-type]
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter(
            "ferrox:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "ferrox:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "ferrox:inter_token_latency_seconds", "Time between tokens of a request.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.frontend_latency = Histogram(
            "ferrox:frontend_token_latency_seconds",
            "From the engine sending a step to the frontend handing its token on "
            "(IPC, detokenization, stop strings, encoding, writing the SSE event).",
            labels, buckets=_FRONTEND_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "ferrox:e2e_request_latency_seconds", "Arrival to last token.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "ferrox:request_queue_time_seconds", "Arrival to first scheduling.", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Histogram(
            "ferrox:request_prompt_tokens", "Prompt tokens per request.", labels,
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.generation_tokens = Histogram(
            "ferrox:request_generation_tokens", "Generated tokens per request.", labels,
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_request(
        self,
        *,
        finished_reason: str,
        ttft: float | None,
        itls: list[float],
        frontend_latencies: Sequence[float] = (),
        e2e: float,
        queue_time: float | None,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        m = self.model
        self.request_success.labels(m, finished_reason).inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        itl = self.itl.labels(m)
        for gap in itls:
            itl.observe(gap)
        frontend = self.frontend_latency.labels(m)
        for latency in frontend_latencies:
            frontend.observe(latency)
        self.e2e.labels(m).observe(e2e)
        if queue_time is not None:
            self.queue_time.labels(m).observe(max(queue_time, 0.0))
        self.prompt_tokens.labels(m).observe(prompt_tokens)
        self.generation_tokens.labels(m).observe(generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
