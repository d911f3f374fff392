"""Prometheus families of the KV cache tiers and pins, fed by the core's ``StepStats`` snapshots.

Kept apart from server/metrics.py (``Metrics`` owns one collector, registers it next to its own
families and hands it every snapshot). Every family carries ``model_name`` and, where it
applies, ``tier`` = ``device`` | ``host`` | ``disk``; the host and disk series exist (as zeros)
even when the server runs without those tiers, so dashboards never go blank.

- ``kv_tier_queries_total`` / ``kv_tier_hits_total``: prompt tokens looked up in / found in the
  tier at a request's first admission (host: the tokens after the device chain ended; disk:
  those of them the host tier did not hold);
- ``kv_tier_read_bytes_total`` (device: hit tokens x KV bytes per token; host, disk: payload
  bytes read) and ``kv_tier_written_bytes_total`` (host, disk: payload bytes written);
- gauges ``kv_tier_usage_bytes`` / ``kv_tier_capacity_bytes`` and ``kv_pinned_blocks``;
- histograms ``kv_offload_write_seconds`` / ``kv_offload_read_seconds`` (one block each).

Snapshot contract (engine/core_protocol.StepStats): counters arrive as deltas and are summed
here (a restarted core never makes them go backwards), gauges are absolute, and latencies come
as the observations made since the previous snapshot. Nothing here reads engine state.
"""
from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from cache.tiers import LATENCY_BUCKETS
from engine.core.protocol import EngineInfo, StepStats
from server.histogram import StepHistogram

NAMESPACE = "kvserve"
TIERS = ("device", "host", "disk")
LOWER_TIERS = TIERS[1:]


class KVTierCollector:
    """Totals and the latest gauges from the snapshots ``update`` receives (one receiving thread);
    ``collect`` (the scrape) reads them under a lock."""

    def __init__(self, model_name: str, info: EngineInfo) -> None:
        self.model_name = model_name
        self.info = info
        self._lock = threading.Lock()
        self.queries = {t: 0 for t in TIERS}
        self.hits = {t: 0 for t in TIERS}
        self.bytes_read = {t: 0 for t in LOWER_TIERS}
        self.bytes_written = {t: 0 for t in LOWER_TIERS}
        self.state = StepStats(kv_num_blocks=info.num_blocks, kv_block_size=info.block_size)
        self.latency = {(kind, tier): StepHistogram(LATENCY_BUCKETS) for kind in ("write", "read") for tier in LOWER_TIERS}

    def update(self, stats: StepStats) -> None:
        if not (stats.tier_queries or stats.tier_hits or stats.tier_bytes_read or stats.tier_bytes_written
                or stats.offload_write_seconds or stats.offload_read_seconds):
            self.state = stats  # most steps: no tier moved (zero deltas are not sent), only the gauges
            return
        with self._lock:
            for tier, n in stats.tier_queries.items():
                self.queries[tier] = self.queries.get(tier, 0) + n
            for tier, n in stats.tier_hits.items():
                self.hits[tier] = self.hits.get(tier, 0) + n
            for tier, n in stats.tier_bytes_read.items():
                self.bytes_read[tier] = self.bytes_read.get(tier, 0) + n
            for tier, n in stats.tier_bytes_written.items():
                self.bytes_written[tier] = self.bytes_written.get(tier, 0) + n
            for kind, per_tier in (("write", stats.offload_write_seconds), ("read", stats.offload_read_seconds)):
                for tier, observed in per_tier.items():
                    histogram = self.latency.get((kind, tier))
                    if histogram is None:
                        histogram = self.latency[kind, tier] = StepHistogram(LATENCY_BUCKETS)
                    for seconds in observed:
                        histogram.observe(seconds)
            self.state = stats

    def collect(self):
        name, info = self.model_name, self.info
        with self._lock:
            queries, hits = dict(self.queries), dict(self.hits)
            read, written, state = dict(self.bytes_read), dict(self.bytes_written), self.state
            latency = {}
            for kind in ("write", "read"):
                latency[kind] = HistogramMetricFamily(f"{NAMESPACE}_kv_offload_{kind}_seconds",
                                                      f"Seconds per block {kind} of each lower KV tier.",
                                                      labels=["model_name", "tier"])
                for (k, tier), histogram in self.latency.items():
                    if k == kind:
                        histogram.add_to(latency[kind], [name, tier])

        def family(kind: type, metric: str, doc: str, values: dict[str, float]):
            f = kind(f"{NAMESPACE}_{metric}", doc, labels=["model_name", "tier"])
            for tier_name, value in values.items():
                f.add_metric([name, tier_name], value)
            return f

        per_token = info.kv_bytes_per_token
        yield family(CounterMetricFamily, "kv_tier_queries", "Prompt tokens looked up in each KV tier.",
                     {t: queries.get(t, 0) for t in TIERS})
        yield family(CounterMetricFamily, "kv_tier_hits", "Prompt tokens found in each KV tier.",
                     {t: hits.get(t, 0) for t in TIERS})
        yield family(CounterMetricFamily, "kv_tier_read_bytes", "KV bytes served from each tier.",
                     {"device": hits.get("device", 0) * per_token, **read})
        yield family(CounterMetricFamily, "kv_tier_written_bytes", "KV bytes written into each lower tier.",
                     written)
        yield family(GaugeMetricFamily, "kv_tier_usage_bytes", "Bytes in use in each KV tier.",
                     {"device": state.kv_used_blocks * info.block_size * per_token,
                      **{t: state.tier_usage_bytes.get(t, 0) for t in LOWER_TIERS}})
        yield family(GaugeMetricFamily, "kv_tier_capacity_bytes", "Capacity of each KV tier in bytes.",
                     {"device": info.num_blocks * info.block_size * per_token,
                      **{t: state.tier_capacity_bytes.get(t, 0) for t in LOWER_TIERS}})
        pinned = GaugeMetricFamily(f"{NAMESPACE}_kv_pinned_blocks", "KV blocks held by cache_control pins.",
                                   labels=["model_name"])
        pinned.add_metric([name], state.kv_pinned_blocks)
        yield pinned
        yield from latency.values()
