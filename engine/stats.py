"""The engine's stats snapshots: what ``LLMEngine.stats()`` sends with each core message.

``EngineCounters`` are the monotonic counters the engine reads off the scheduler and the lower
KV tiers, by name; ``StatsReporter`` turns them into ``StepStats`` (engine/core/protocol.py, the
wire type) with the counters as deltas since its previous snapshot and the gauges as they are
now, and tells the idle core whether a snapshot would say anything new.

Contract: a snapshot's counters are deltas since the previous ``snapshot`` call of the same
reporter (the first: since the engine started), so a restarted core never makes a frontend
counter go backwards; latency observations are drained (each one is sent once).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cache.kv_cache_manager import KVCacheManager
from cache.memory import KVCapacity
from cache.tiers import KVTier
from engine.core.protocol import PinSnapshot, StepStats
from scheduler.scheduler import Scheduler


def _minus(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-tier deltas over the names ``now`` holds (a name new since ``before`` counts from 0),
    zeros left out: most steps move no tier, and the frontend reads every entry a step carries."""
    return {name: delta for name, value in now.items() if (delta := value - before.get(name, 0))}


def _minus_pos(now: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    """Per-position deltas (positions only ever get added, so ``now`` is at least as long)."""
    return tuple(value - (before[i] if i < len(before) else 0) for i, value in enumerate(now))


@dataclass(frozen=True)
class EngineCounters:
    """Monotonic counters: prompt tokens looked up / found in the prefix cache, preemptions,
    tokens looked up / found per tier (``device``, ``host``, ``disk``) and the lower tiers'
    payload bytes read / written, and speculative decoding's drafts, draft tokens, accepted
    tokens and accepted tokens per draft position."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    tier_queries: dict[str, int] = field(default_factory=dict)
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_bytes_read: dict[str, int] = field(default_factory=dict)
    tier_bytes_written: dict[str, int] = field(default_factory=dict)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    kv_evicted_blocks: int = 0

    @classmethod
    def read(cls, scheduler: Scheduler, tiers: list[KVTier]) -> EngineCounters:
        sched = scheduler.stats
        return cls(prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
                   num_preemptions=sched.num_preemptions, tier_queries=dict(sched.tier_queries),
                   tier_hits=dict(sched.tier_hits),
                   tier_bytes_read={t.name: t.stats.bytes_read for t in tiers},
                   tier_bytes_written={t.name: t.stats.bytes_written for t in tiers},
                   spec_num_drafts=sched.spec_num_drafts, spec_num_draft_tokens=sched.spec_draft_tokens,
                   spec_num_accepted_tokens=sched.spec_accepted_tokens,
                   spec_num_accepted_tokens_per_pos=tuple(sched.spec_accepted_per_pos),
                   kv_evicted_blocks=scheduler.kv_cache.num_evicted_blocks_total)

    def since(self, before: EngineCounters) -> EngineCounters:
        """The counts from ``before`` to this."""
        return EngineCounters(
            prefix_cache_queries=self.prefix_cache_queries - before.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - before.prefix_cache_hits,
            num_preemptions=self.num_preemptions - before.num_preemptions,
            tier_queries=_minus(self.tier_queries, before.tier_queries),
            tier_hits=_minus(self.tier_hits, before.tier_hits),
            tier_bytes_read=_minus(self.tier_bytes_read, before.tier_bytes_read),
            tier_bytes_written=_minus(self.tier_bytes_written, before.tier_bytes_written),
            spec_num_drafts=self.spec_num_drafts - before.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens - before.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=_minus_pos(self.spec_num_accepted_tokens_per_pos,
                                                        before.spec_num_accepted_tokens_per_pos),
            kv_evicted_blocks=self.kv_evicted_blocks - before.kv_evicted_blocks)


def pin_snapshots(kv_cache: KVCacheManager) -> tuple[PinSnapshot, ...]:
    """The live pins as the frontend lists them, ``ttl_left_s`` as of now."""
    now = kv_cache.clock()
    return tuple(PinSnapshot(hash=p.hash, num_tokens=p.num_tokens, num_blocks=p.num_blocks, ttl_s=p.ttl_s,
                             ttl_left_s=round(max(0.0, p.expires_at - now), 3), salt_id=p.salt_id,
                             tenant=p.tenant)
                 for p in kv_cache.list_pins())


class StatsReporter:
    """Snapshots of one engine's scheduler, pool and tiers (engine thread only)."""

    def __init__(self, scheduler: Scheduler, kv_cache: KVCacheManager, capacity: KVCapacity) -> None:
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.capacity = capacity
        self._reported = EngineCounters()  # counters at the previous snapshot (deltas are sent)
        self._reported_pins: tuple[PinSnapshot, ...] = ()  # the pin list of the previous snapshot

    def changed(self, tiers: list[KVTier]) -> bool:
        """Whether a snapshot now would differ from the previous one in pins or counters, or
        would carry latency observations (pin expiry times alone do not count)."""
        keys = tuple(p.hash for p in self.kv_cache.list_pins())
        return (keys != tuple(p.hash for p in self._reported_pins)
                or EngineCounters.read(self.scheduler, tiers) != self._reported
                or any(t.stats.recent_write_seconds or t.stats.recent_read_seconds for t in tiers))

    def snapshot(self, tiers: list[KVTier], step_time_s: float = 0.0, num_batched_tokens: int = 0) -> StepStats:
        """Gauges now, counters since the previous snapshot; ``tiers`` are the lower tiers, top
        first; ``num_batched_tokens`` and ``step_time_s`` describe the step it follows (0: none)."""
        sched, pool, capacity = self.scheduler, self.kv_cache.block_pool, self.capacity
        counters = EngineCounters.read(sched, tiers)
        delta = counters.since(self._reported)
        self._reported = counters
        pins = pin_snapshots(self.kv_cache)
        self._reported_pins = pins
        return StepStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         kv_used_blocks=capacity.num_blocks - self.kv_cache.num_free_blocks,
                         kv_cached_blocks=pool.num_cached_blocks,
                         kv_num_blocks=capacity.num_blocks, kv_block_size=capacity.block_size,
                         prefix_cache_queries=delta.prefix_cache_queries, prefix_cache_hits=delta.prefix_cache_hits,
                         num_preemptions=delta.num_preemptions,
                         num_batched_tokens=num_batched_tokens, step_time_s=step_time_s,
                         tier_queries=delta.tier_queries, tier_hits=delta.tier_hits,
                         tier_bytes_read=delta.tier_bytes_read, tier_bytes_written=delta.tier_bytes_written,
                         tier_usage_bytes={t.name: t.usage_bytes() for t in tiers},
                         tier_capacity_bytes={t.name: t.capacity_bytes() for t in tiers},
                         offload_write_seconds={t.name: t.stats.drain_recent("write") for t in tiers},
                         offload_read_seconds={t.name: t.stats.drain_recent("read") for t in tiers},
                         kv_pinned_blocks=self.kv_cache.num_pinned_blocks, pins=pins,
                         kv_evicted_blocks=delta.kv_evicted_blocks,
                         kv_eviction_seen_tokens=sum(r.num_computed_tokens for r in sched.running if r.evicts),
                         kv_eviction_held_tokens=sum(r.num_computed_tokens - r.num_evicted_tokens
                                                     for r in sched.running if r.evicts),
                         spec_num_drafts=delta.spec_num_drafts, spec_num_draft_tokens=delta.spec_num_draft_tokens,
                         spec_num_accepted_tokens=delta.spec_num_accepted_tokens,
                         spec_num_accepted_tokens_per_pos=delta.spec_num_accepted_tokens_per_pos)
