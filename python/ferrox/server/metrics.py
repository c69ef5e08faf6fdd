"""Prometheus metrics, named after vLLM's with a `ferrox:` prefix.

Engine-side figures (queue sizes, KV usage, prefix hits, token totals) come
from the latest stats the engine process sent; request latencies are
observed in the frontend as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ferrox.common.outputs import FINISH_REASONS
from ferrox.common.protocol import EngineStats
from ferrox.frontend.request_run import FinishedRequest

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_FRONTEND_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


class _EngineCollector:
    """The engine-side figures of every replica (one sample per replica,
    labelled `replica`; one engine is replica "0")."""

    def __init__(self, stats: Callable[[], list[EngineStats]], model: str) -> None:
        self.stats = stats
        self.model = model

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, s in enumerate(self.stats()):
            for family in self._collect_one(s, str(replica)):
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()

    def _collect_one(self, s: EngineStats, replica: str) -> Iterator[Metric]:
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"ferrox:{name}", doc, labels=labels)
            g.add_metric([self.model, replica], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"ferrox:{name}", doc, labels=labels)
            c.add_metric([self.model, replica], value)
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
        if s.num_window_blocks:
            yield gauge(
                "kv_cache_window_total_blocks",
                "KV blocks in the sliding-window layers' pool.",
                s.num_window_blocks,
            )
            yield gauge(
                "kv_cache_window_free_blocks",
                "Free KV blocks in the sliding-window layers' pool.",
                s.num_free_window_blocks,
            )
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
        yield from self._speculation(s, counter, replica)
        yield counter(
            "scheduler_integrity_failures",
            "Idle-time scheduler integrity checks that failed (a bug in ferrox).",
            s.integrity_failures,
        )

    def _speculation(
        self,
        s: EngineStats,
        counter: Callable[[str, str, float], CounterMetricFamily],
        replica: str,
    ) -> Iterator[Metric]:
        """Speculative decoding (vLLM's spec_decode_* names)."""
        yield counter(
            "spec_decode_num_drafts",
            "Verifications of draft tokens (one per request and step that speculated).",
            s.spec_num_drafts,
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            s.spec_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "ferrox:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labels=["model_name", "replica", "position"],
        )
        for i, n in enumerate(s.spec_accepted_per_position):
            if n or i == 0:
                per_pos.add_metric([self.model, replica, str(i)], n)
        yield per_pos
        # Tokens a verification yields: the accepted drafts and the one after.
        buckets, total, cumulative = [], 0.0, 0
        for accepted, n in enumerate(s.spec_accepted_lengths):
            cumulative += n
            total += n * (accepted + 1)
            buckets.append((str(float(accepted + 1)), cumulative))
        hist = HistogramMetricFamily(
            "ferrox:spec_decode_acceptance_length",
            "Tokens each verification yielded (accepted drafts + 1).",
            labels=["model_name", "replica"],
        )
        hist.add_metric([self.model, replica], [*buckets, ("+Inf", cumulative)], total)
        yield hist


class Metrics:
    def __init__(self, model: str, stats: Callable[[], list[EngineStats]]) -> None:
        """`stats`: the latest engine stats of each replica."""
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(stats, model))  # type: ignore[arg-type]
        self.request_success = Counter(
            "ferrox:request_success",
            "Finished requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # each series at 0 from the start, as vLLM's
            self.request_success.labels(model, reason)
        self.requests_rejected = Counter(
            "ferrox:requests_rejected",
            "Requests answered 503 before any work: the server was at capacity or draining.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.admitted = Gauge(
            "ferrox:num_requests_admitted",
            "Engine requests the frontend has admitted and not yet answered in full.",
            ["model_name"],
            registry=self.registry,
        ).labels(model)
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Time between tokens of a request.", _LATENCY_BUCKETS
        )
        self.frontend_latency = self._histogram(
            "frontend_token_latency_seconds",
            "From the engine sending a step to the frontend handing its token on "
            "(IPC, detokenization, stop strings, encoding, writing the SSE event).",
            _FRONTEND_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        self.prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "First scheduling to first token (the prompt's prefill).",
            _LATENCY_BUCKETS,
        )
        self.decode_time = self._histogram(
            "request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        )
        self.inference_time = self._histogram(
            "request_inference_time_seconds",
            "First scheduling to last token (prefill and decode).",
            _LATENCY_BUCKETS,
        )
        self.params_n = self._histogram("request_params_n", "The n of each request.", _N_BUCKETS)
        self.params_max_tokens = self._histogram(
            "request_params_max_tokens", "The max_tokens of each request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total",
            "Tokens computed per engine step (prefill chunks and decodes).",
            _STEP_TOKEN_BUCKETS,
        )
        self.cache_config = Gauge(
            "ferrox:cache_config_info",
            "The KV cache's configuration, in the labels (the value is 1).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
            registry=self.registry,
        )

    def set_cache_config(
        self, *, block_size: int, num_blocks: int, prefix_caching: bool, dtype: str
    ) -> None:
        self.cache_config.labels(str(block_size), str(num_blocks), str(prefix_caching), dtype).set(
            1
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram labelled with the served model's name (its only label)."""
        family = Histogram(
            f"ferrox:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
        )
        return family.labels(self.model)

    def observe_request(self, request: FinishedRequest) -> None:
        r = request
        self.request_success.labels(self.model, r.finished_reason).inc()
        for histogram, value in (
            (self.prefill_time, r.prefill_time),
            (self.decode_time, r.decode_time),
            (self.inference_time, r.inference_time),
            (self.params_max_tokens, r.max_tokens),
        ):
            if value is not None:
                histogram.observe(max(value, 0.0))
        self.params_n.observe(r.n)
        if r.ttft is not None:
            self.ttft.observe(r.ttft)
        for gap in r.itls:
            self.itl.observe(gap)
        for latency in r.frontend_latencies:
            self.frontend_latency.observe(latency)
        self.e2e.observe(r.e2e)
        if r.queue_time is not None:
            self.queue_time.observe(max(r.queue_time, 0.0))
        self.prompt_tokens.observe(r.prompt_tokens)
        self.generation_tokens.observe(r.generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
