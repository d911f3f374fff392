"""Prometheus metrics with vLLM's names under the ``kvserve_`` namespace.

Three sources, each read where it is cheapest:
- per-request latencies and token counts, from the engine outputs the loop thread hands to
  ``on_step`` (histograms and counters, updated in the loop thread);
- scheduler and KV-cache state (gauges, prefix-cache and preemption counters), read at
  scrape time by a custom collector, so the hot path pays nothing for them;
- a periodic log line built from counter deltas.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger("kvserve.stats")
# The *_created series double the exposition for no dashboard use (vLLM drops them too).
disable_created_metrics()

NAMESPACE = "kvserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class _Timing:
    last_token_time: float | None = None


class Metrics:
    def __init__(self, model_name: str, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), namespace=NAMESPACE, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, namespace=NAMESPACE, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = counter("request_success", "Requests finished normally, by finish reason.",
                                       ("finished_reason",))
        self.request_errors = counter("request_errors", "Requests that ended in abort or error, by reason.",
                                      ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first output token.",
                              LATENCY_BUCKETS).labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             LATENCY_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output token.",
                             LATENCY_BUCKETS).labels(model_name)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first admission.",
                                    LATENCY_BUCKETS).labels(model_name)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               TOKEN_BUCKETS).labels(model_name)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of finished requests.",
                                                   TOKEN_BUCKETS).labels(model_name)
        self.iteration_tokens = histogram("iteration_tokens", "Tokens run by one engine step.",
                                          TOKEN_BUCKETS).labels(model_name)
        self.registry.register(_EngineStateCollector(self))
        self._timings: dict[str, _Timing] = {}
        self._last_log = (time.monotonic(), 0.0, 0.0, 0, 0)

    # ---- called in the engine loop thread ------------------------------------------------------
    def on_step(self, num_tokens: int, outputs: list[RequestOutput]) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        now = time.monotonic()
        for out in outputs:
            timing = self._timings.setdefault(out.request_id, _Timing())
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
                if timing.last_token_time is None:
                    if out.arrival_time is not None:
                        self.ttft.observe(now - out.arrival_time)
                else:
                    self.itl.observe(now - timing.last_token_time)
                timing.last_token_time = now
            if out.finished:
                self._timings.pop(out.request_id, None)
                self._on_finished(out, now)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        reason = out.finish_reason or "error"
        if reason in ("stop", "length"):
            self.request_success.labels(self.model_name, reason).inc()
        else:
            self.request_errors.labels(self.model_name, reason).inc()
        if out.num_prompt_tokens:
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.request_prompt_tokens.observe(out.num_prompt_tokens)
            self.request_generation_tokens.observe(out.num_output_tokens)
        if out.arrival_time is not None:
            self.e2e.observe(now - out.arrival_time)
            if out.first_scheduled_time is not None:
                self.queue_time.observe(out.first_scheduled_time - out.arrival_time)

    # ---- scrape and log -------------------------------------------------------------------------
    async def route(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def log_stats(self) -> None:
        """One line of throughput and cache state since the previous call (only when there was work)."""
        sched = self.engine.scheduler
        now = time.monotonic()
        prompt = sched.stats.prefix_cache_queries - sched.stats.prefix_cache_hits  # computed prompt tokens
        gen = self.generation_tokens._value.get()
        t0, prompt0, gen0, queries0, hits0 = self._last_log
        self._last_log = (now, prompt, gen, sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits)
        if gen == gen0 and prompt == prompt0 and not sched.has_unfinished():
            return
        dt = max(now - t0, 1e-9)
        queries = sched.stats.prefix_cache_queries - queries0
        hits = sched.stats.prefix_cache_hits - hits0
        logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
                    "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    (prompt - prompt0) / dt, (gen - gen0) / dt, sched.num_running, sched.num_waiting,
                    100 * self.engine.kv_cache.usage, 100 * hits / queries if queries else 0.0)


class _EngineStateCollector:
    """Gauges and scheduler counters read at scrape time (racy reads of ints are fine here)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        name = self.metrics.model_name
        sched, kv, cap = engine.scheduler, engine.kv_cache, engine.capacity

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{NAMESPACE}_{metric}", doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{NAMESPACE}_{metric}", doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        used_blocks = kv.block_pool.num_blocks - kv.num_free_blocks
        yield gauge("num_requests_running", "Requests in the running batch.", sched.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted (preempted ones included).",
                    sched.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live requests (0..1).", kv.usage)
        yield gauge("kv_cache_used_tokens", "KV token slots in blocks held by live requests.",
                    used_blocks * cap.block_size)
        yield gauge("kv_cache_capacity_tokens", "KV token slots in the whole pool.", cap.num_tokens)
        yield gauge("kv_cache_cached_blocks", "Free blocks kept for prefix reuse (evictable).",
                    kv.block_pool.num_cached_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      sched.stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", sched.stats.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", sched.stats.num_preemptions)
        info = InfoMetricFamily(f"{NAMESPACE}_cache_config", "KV cache configuration.", labels=["model_name"])
        info.add_metric([name], {"block_size": str(cap.block_size), "num_blocks": str(cap.num_blocks),
                                 "cache_dtype": engine.config.model.dtype,
                                 "enable_prefix_caching": str(engine.config.cache.enable_prefix_caching).lower()})
        yield info
