"""Prometheus metrics with vLLM's names under the ``kvserve_`` namespace.

Exported families (every one labelled ``model_name``; ``promtool check metrics`` clean):

- gauges, from the latest step snapshot: ``num_requests_running``, ``num_requests_waiting`` (the
  scheduler's queues; preempted requests wait again), ``kv_cache_usage_perc`` (0..1, blocks
  held by live requests), ``kv_cache_used_tokens`` (token slots in those blocks: block
  granular, a block shared by several requests counts once), ``kv_cache_capacity_tokens``,
  ``kv_cache_cached_blocks`` (free blocks still hashed, i.e. evictable prefix-cache entries)
  and ``cache_config_info`` (block size, number of blocks, dtype, prefix caching on/off);
- counters: ``prompt_tokens_total`` (counted when a request's prefill completes, i.e. with its
  first token, like vLLM), ``generation_tokens_total`` (every sampled token),
  ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (prompt tokens looked up / found
  at a request's first admission; re-admission after preemption is not a query),
  ``num_preemptions_total``, ``request_success_total{finished_reason=stop|length}`` and
  ``request_errors_total{reason=abort|error}``; speculative decoding's
  ``spec_decode_num_drafts_total``, ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total`` (exported from the start, 0 while speculation is off,
  so a dashboard's acceptance rate has a baseline) and
  ``spec_decode_num_accepted_tokens_per_pos_total{position}`` (position 0 is the first draft
  token; a position appears once a draft reached it);
- histograms: ``time_to_first_token_seconds`` and ``inter_token_latency_seconds`` (observed as
  tokens come out, so an aborted request's tokens count too), and, for requests that finished
  normally only (so disconnects and engine failures do not skew the percentiles),
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``, ``request_prompt_tokens``,
  ``request_generation_tokens``; plus ``iteration_tokens`` (tokens per engine step) and
  ``engine_step_seconds`` (the core's own time for each step that ran tokens: schedule, forward,
  sampling and bookkeeping; what ``inter_token_latency_seconds`` adds to it is the serving path:
  the outputs' trip to the frontend, the frontend's work and other processes' share of the CPUs);
- eviction inside sequences (``--kv-eviction``, labelled ``policy``, ``none`` when off): the
  counters ``kv_evicted_blocks_total`` and ``kv_evicted_tokens_total`` and the gauge
  ``kv_eviction_compression_ratio`` (tokens the running evicting requests computed / tokens they
  hold; 1 when none runs);
- the KV tier and pin families of ``server/cache_metrics.py``, fed the same snapshots;
- the per-tenant counters ``kvserve_tenant_*`` of ``server/tenants/metrics.py`` (requests, tokens,
  admission rejections, labelled ``tenant``), counted by the serving layer as responses end.

Counting is per *engine request*: a completion with ``n`` choices or several prompts is that
many engine requests, so with ``n > 1`` ``prompt_tokens_total`` counts the prompt ``n`` times
while the response's ``usage.prompt_tokens`` counts it once.

``request_errors_total`` counts engine-level failures only, as vLLM does: requests the HTTP
layer rejects before they reach the engine (validation 400s, auth 401, model 404, overload
429) are not counted; their status codes belong to HTTP access metrics or logs, and a bad
client must not look like an unhealthy engine on an alerting dashboard.

One source: the engine client's observer call per step (``on_step``, in the client's receiving
thread), which brings the core's ``StepStats`` snapshot (gauges absolute, counters as per-step
deltas, so a restarted core never makes a counter go backwards) and the step's
``RequestOutput``s (per-request latencies and token counts). Nothing reads engine state from
another thread: the scrape collector reads the latest snapshot object, which is only ever
replaced whole. ``log_stats`` (every ``ServerConfig.log_stats_interval_s``) logs counter
deltas and stays quiet while the engine is idle.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.core.protocol import EngineInfo, StepStats
from server.cache_metrics import KVTierCollector
from server.histogram import StepHistogram
from kvtypes.outputs import RequestOutput

logger = logging.getLogger("kvserve.stats")
# The *_created series double the exposition for no dashboard use (vLLM drops them too).
disable_created_metrics()

NAMESPACE = "kvserve"
SUCCESS_REASONS = ("stop", "length")
# Buckets follow vLLM's, whose upper ends leave room for long CPU generations: a quantile
# past the last finite bucket would read as that bucket's bound.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
# engine steps: ~1 ms (a small model's decode row) to seconds (a long prefill chunk)
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                        0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0, 1280.0, 2560.0, 7680.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's request-length buckets)."""
    out, exp = [], 1
    while True:
        for m in (1, 2, 5):
            if m * exp > max_value:
                return tuple(out)
            out.append(m * exp)
        exp *= 10


def buckets_pow2(max_value: int) -> tuple[int, ...]:
    """1, 8, 16, 32, ... up to ``max_value``, which is always the last bucket (tokens per step)."""
    out, value = [1], 8
    while value < max_value:
        out.append(value)
        value *= 2
    if max_value > 1:
        out.append(max_value)
    return tuple(out)


@dataclass
class _Timing:
    last_token_time: float | None = None


class Metrics:
    """The engine's observer (``on_step``) and the ``/metrics`` route; see the module docstring."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.model_name = model_name = info.model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), namespace=NAMESPACE, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, namespace=NAMESPACE, buckets=buckets, registry=self.registry)

        length_buckets = buckets_1_2_5(info.max_model_len)
        step_buckets = buckets_pow2(info.max_num_batched_tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill completed.").labels(
            model_name)
        # Observed every step and streamed token: plain numbers, exported by _StepCollector
        self.generation_tokens = 0
        self.itl = StepHistogram(ITL_BUCKETS)
        self.iteration_tokens = StepHistogram(step_buckets)
        self.step_seconds = StepHistogram(STEP_SECONDS_BUCKETS)
        self.request_success = counter("request_success", "Requests finished normally, by finish reason.",
                                       ("finished_reason",))
        self.request_errors = counter("request_errors",
                                      "Engine requests that ended in abort or error, by reason (HTTP-level "
                                      "rejections are not counted).", ("reason",))
        for reason in SUCCESS_REASONS:  # export zeros from the start, so rate() has a baseline
            self.request_success.labels(model_name, reason)
        for reason in ("abort", "error"):
            self.request_errors.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first output token.",
                              TTFT_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last output token (finished requests).",
                             E2E_BUCKETS).labels(model_name)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to first admission (finished requests).",
                                    QUEUE_BUCKETS).labels(model_name)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                               length_buckets).labels(model_name)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of finished requests.",
                                                   length_buckets).labels(model_name)
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache at first admission."
                                            ).labels(model_name)
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache at first admission.").labels(model_name)
        self.num_preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.").labels(model_name)
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified.").labels(model_name)
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                             "Draft tokens verified.").labels(model_name)
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted.").labels(model_name)
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Drafts whose token at this position was accepted.", ("position",))
        policy = info.kv_eviction
        self.kv_evicted_blocks = counter("kv_evicted_blocks", "KV blocks evicted inside sequences "
                                         "(--kv-eviction), by policy.", ("policy",)).labels(model_name, policy)
        self.kv_evicted_tokens = counter("kv_evicted_tokens", "Tokens whose KV was evicted inside sequences, "
                                         "by policy.", ("policy",)).labels(model_name, policy)
        self.registry.register(_EngineStateCollector(self))
        self.registry.register(_StepCollector(self))
        # KV tier and pin families (server/cache_metrics.py), fed the same snapshots
        self.tiers = KVTierCollector(model_name, info)
        self.registry.register(self.tiers)
        self.state = StepStats(kv_num_blocks=info.num_blocks, kv_block_size=info.block_size)  # replaced whole
        # What /metrics serializes: the registry, or a wrapper (server.metrics_compat) around it.
        self.exposition = self.registry
        self._timings: dict[str, _Timing] = {}
        # Plain totals for the log line (written in the receiving thread, read by log_stats).
        self._num_prompt_tokens = 0
        self._num_queries = 0
        self._num_hits = 0
        self._last_log = (time.monotonic(), 0, 0, 0, 0)

    # ---- called in the engine client's receiving thread ------------------------------------------
    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        try:
            self._on_step(stats, outputs)
        except Exception:  # noqa: BLE001 - a metrics bug must never stop the outputs
            logger.exception("metrics update failed")

    def _on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        if stats is not None:
            self.state = stats
            self.tiers.update(stats)
            if stats.num_batched_tokens:
                self.iteration_tokens.observe(stats.num_batched_tokens)
                self.step_seconds.observe(stats.step_time_s)
            if stats.prefix_cache_queries:
                self.prefix_cache_queries.inc(stats.prefix_cache_queries)
                self._num_queries += stats.prefix_cache_queries
            if stats.prefix_cache_hits:
                self.prefix_cache_hits.inc(stats.prefix_cache_hits)
                self._num_hits += stats.prefix_cache_hits
            if stats.num_preemptions:
                self.num_preemptions.inc(stats.num_preemptions)
            if stats.kv_evicted_blocks:
                self.kv_evicted_blocks.inc(stats.kv_evicted_blocks)
                self.kv_evicted_tokens.inc(stats.kv_evicted_blocks * self.info.block_size)
            if stats.spec_num_drafts:
                self._on_spec(stats)
        now = time.monotonic()
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is None:
                timing = self._timings[out.request_id] = _Timing()
            if out.new_token_ids:
                n = len(out.new_token_ids)
                self.generation_tokens += n
                if timing.last_token_time is None:  # first token: the prefill is done
                    if out.arrival_time is not None:
                        self.ttft.observe(now - out.arrival_time)
                    if out.num_prompt_tokens:
                        self.prompt_tokens.inc(out.num_prompt_tokens)
                        self._num_prompt_tokens += out.num_prompt_tokens
                else:
                    self.itl.observe(now - timing.last_token_time)
                timing.last_token_time = now
            if out.finished:
                self._timings.pop(out.request_id, None)
                self._on_finished(out, now)

    def _on_spec(self, stats: StepStats) -> None:
        self.spec_num_drafts.inc(stats.spec_num_drafts)
        self.spec_num_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.spec_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
        for position, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
            child = self.spec_accepted_per_pos.labels(self.model_name, str(position))  # created at first sight
            if n:
                child.inc(n)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        reason = out.finish_reason or "error"
        if reason not in SUCCESS_REASONS:
            self.request_errors.labels(self.model_name, reason).inc()
            return
        self.request_success.labels(self.model_name, reason).inc()
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_output_tokens)
        if out.arrival_time is not None:
            self.e2e.observe(now - out.arrival_time)
            if out.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, out.first_scheduled_time - out.arrival_time))

    # ---- scrape and log -------------------------------------------------------------------------
    async def route(self) -> Response:
        return Response(generate_latest(self.exposition), media_type=CONTENT_TYPE_LATEST)

    def log_stats(self) -> None:
        """One line of throughput and cache state since the previous call (only when there was work)."""
        state = self.state
        now = time.monotonic()
        prompt, gen, queries, hits = (self._num_prompt_tokens, self.generation_tokens, self._num_queries,
                                      self._num_hits)
        t0, prompt0, gen0, queries0, hits0 = self._last_log
        self._last_log = (now, prompt, gen, queries, hits)
        if gen == gen0 and prompt == prompt0 and queries == queries0 and not (state.num_running or state.num_waiting):
            return
        dt = max(now - t0, 1e-9)
        queried = queries - queries0
        logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
                    "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    (prompt - prompt0) / dt, (gen - gen0) / dt, state.num_running, state.num_waiting,
                    100 * state.kv_usage, 100 * (hits - hits0) / queried if queried else 0.0)


class _EngineStateCollector:
    """Gauges from the latest ``StepStats`` snapshot (an object no thread mutates)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        state, info = self.metrics.state, self.metrics.info
        name = self.metrics.model_name

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{NAMESPACE}_{metric}", doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        yield gauge("num_requests_running", "Requests in the running batch.", state.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be admitted (preempted ones included).",
                    state.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live requests (0..1).", state.kv_usage)
        yield gauge("kv_cache_used_tokens", "KV token slots in blocks held by live requests.", state.kv_used_tokens)
        yield gauge("kv_cache_capacity_tokens", "KV token slots in the whole pool.", info.num_tokens)
        yield gauge("kv_cache_cached_blocks", "Free blocks kept for prefix reuse (evictable).", state.kv_cached_blocks)
        ratio = GaugeMetricFamily(f"{NAMESPACE}_kv_eviction_compression_ratio", "Tokens the running evicting "
                                  "requests computed over the tokens they hold (1 when none evicts).",
                                  labels=["model_name", "policy"])
        held = state.kv_eviction_held_tokens
        ratio.add_metric([name, info.kv_eviction], state.kv_eviction_seen_tokens / held if held else 1.0)
        yield ratio
        cache_info = InfoMetricFamily(f"{NAMESPACE}_cache_config", "KV cache configuration.", labels=["model_name"])
        cache_info.add_metric([name], {"block_size": str(info.block_size), "num_blocks": str(info.num_blocks),
                                       "cache_dtype": info.dtype if info.kv_cache_dtype == "auto" else info.kv_cache_dtype,
                                       "enable_prefix_caching": str(info.enable_prefix_caching).lower()})
        yield cache_info


class _StepCollector:
    """The families observed every step (``Metrics.generation_tokens``, ``itl``,
    ``iteration_tokens``, ``step_seconds``), from their plain numbers (server/histogram.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        m, labels = self.metrics, [self.metrics.model_name]
        generated = CounterMetricFamily(f"{NAMESPACE}_generation_tokens", "Generated tokens.", labels=["model_name"])
        generated.add_metric(labels, m.generation_tokens)
        yield generated
        for histogram, metric, doc in ((m.itl, "inter_token_latency_seconds", "Time between consecutive output tokens."),
                                       (m.iteration_tokens, "iteration_tokens", "Tokens run by one engine step."),
                                       (m.step_seconds, "engine_step_seconds",
                                        "The engine core's time for one step that ran tokens.")):
            family = HistogramMetricFamily(f"{NAMESPACE}_{metric}", doc, labels=["model_name"])
            histogram.add_to(family, labels)
            yield family
