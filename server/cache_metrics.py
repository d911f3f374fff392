"""Prometheus families of the KV cache tiers and pins, read at scrape time.

Kept apart from server/metrics.py (one collector registered next to it). Every family carries
``model_name`` and, where it applies, ``tier`` = ``device`` | ``disk``; the disk series exist
(as zeros) even when the server runs without a disk tier, so dashboards never go blank.

- ``kv_tier_queries_total`` / ``kv_tier_hits_total``: prompt tokens looked up in / found in the
  tier at a request's first admission (disk: the tokens after the device chain ended);
- ``kv_tier_read_bytes_total`` (device: hit tokens x KV bytes per token; disk: payload bytes
  read) and ``kv_tier_written_bytes_total`` (disk: payload bytes written);
- gauges ``kv_tier_usage_bytes`` / ``kv_tier_capacity_bytes`` and ``kv_pinned_blocks``;
- histograms ``kv_offload_write_seconds`` / ``kv_offload_read_seconds`` (one block each).
"""
from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from cache.tiers import LATENCY_BUCKETS, TierStats

NAMESPACE = "kvserve"
TIERS = ("device", "disk")


class KVTierCollector:
    """Reads ints the engine thread updates (racy single reads are fine for metrics)."""

    def __init__(self, model_name: str, engine: Any) -> None:
        self.model_name = model_name
        self.engine = engine

    def collect(self):
        engine, name = self.engine, self.model_name
        stats = engine.scheduler.stats
        kv, cap = engine.kv_cache, engine.capacity
        offloader = getattr(engine, "offloader", None)
        tier = offloader.tier if offloader is not None else None
        disk: TierStats = tier.stats if tier is not None else TierStats()

        def family(kind: type, metric: str, doc: str, values: dict[str, float]):
            f = kind(f"{NAMESPACE}_{metric}", doc, labels=["model_name", "tier"])
            for tier_name, value in values.items():
                f.add_metric([name, tier_name], value)
            return f

        yield family(CounterMetricFamily, "kv_tier_queries", "Prompt tokens looked up in each KV tier.",
                     {t: stats.tier_queries.get(t, 0) for t in TIERS})
        yield family(CounterMetricFamily, "kv_tier_hits", "Prompt tokens found in each KV tier.",
                     {t: stats.tier_hits.get(t, 0) for t in TIERS})
        yield family(CounterMetricFamily, "kv_tier_read_bytes", "KV bytes served from each tier.",
                     {"device": stats.tier_hits.get("device", 0) * cap.bytes_per_token, "disk": disk.bytes_read})
        yield family(CounterMetricFamily, "kv_tier_written_bytes", "KV bytes written into each lower tier.",
                     {"disk": disk.bytes_written})
        used_blocks = cap.num_blocks - kv.num_free_blocks
        yield family(GaugeMetricFamily, "kv_tier_usage_bytes", "Bytes in use in each KV tier.",
                     {"device": used_blocks * cap.block_size * cap.bytes_per_token,
                      "disk": tier.usage_bytes() if tier is not None else 0})
        yield family(GaugeMetricFamily, "kv_tier_capacity_bytes", "Capacity of each KV tier in bytes.",
                     {"device": cap.total_bytes, "disk": tier.capacity_bytes() if tier is not None else 0})
        pinned = GaugeMetricFamily(f"{NAMESPACE}_kv_pinned_blocks", "KV blocks held by cache_control pins.",
                                   labels=["model_name"])
        pinned.add_metric([name], kv.num_pinned_blocks)
        yield pinned
        for kind, counts, total in (("write", disk.write_seconds, disk.write_seconds_sum),
                                    ("read", disk.read_seconds, disk.read_seconds_sum)):
            h = HistogramMetricFamily(f"{NAMESPACE}_kv_offload_{kind}_seconds",
                                      f"Seconds per block {kind} of the disk tier.", labels=["model_name", "tier"])
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], list(counts)):
                cumulative += count
                buckets.append((bound, cumulative))
            h.add_metric([name, "disk"], buckets, total)
            yield h
