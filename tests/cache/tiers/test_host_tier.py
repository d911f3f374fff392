"""The host tier (``--kv-offload-gib``): LRU in a preallocated arena, evictions passed down to the
disk tier, and on the engine an evicted prefix found again there with recompute's outputs."""
from __future__ import annotations

import hashlib

import pytest

from cache.tiers import DiskTier, HostTier, TierChain
from engine.kv.transfer import BlockCopier
from tests.cache.tiers.test_disk_tier_engine import BS, PARAMS, assert_idle, assert_same, flood, prompt
from tests.helpers import tiny_engine, tiny_hf_model


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, n: int = 64) -> bytes:
    return bytes([i % 256]) * n


def test_host_tier_lru_within_its_arena():
    evicted = []
    tier = HostTier(64, bytearray(64 * 3 + 10), on_evict=lambda k, p: evicted.append((k, p)))
    assert tier.num_slots == 3 and tier.capacity_bytes() == 192
    for i in range(3):
        tier.put(h(i), payload(i))
    assert tier.get(h(0)) == payload(0)  # 0 is now the most recently used
    tier.put(h(3), payload(3))  # evicts 1, the least recently used
    assert evicted == [(h(1), payload(1))]
    assert not tier.contains(h(1)) and tier.get(h(1)) is None
    assert [tier.get(h(i)) for i in (0, 2, 3)] == [payload(0), payload(2), payload(3)]
    assert tier.usage_bytes() == 192 and tier.num_entries() == 3
    tier.put(h(9), payload(9, 63))  # not a block of this pool: dropped, nothing evicted
    assert tier.stats.writes_dropped == 1 and len(evicted) == 1
    assert tier.stats.hits == 4 and tier.stats.queries == 5 and tier.stats.bytes_written == 4 * 64
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(64, bytearray(63))


def test_chain_orders_host_before_disk(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, b"f" * 32)
    host = HostTier(64, bytearray(64 * 2))
    chain = TierChain([host, disk])
    for i in range(3):
        chain.put(h(i), payload(i))
    chain.flush(10)
    assert chain.locate(h(0)) == "disk" and chain.locate(h(2)) == "host"  # 0 fell out of the host tier
    assert chain.get(h(2)) == payload(2) and host.stats.hits == 1 and disk.stats.hits == 0
    # A disk hit is promoted into the host tier (evicting its LRU entry, 1, down to disk).
    assert chain.get(h(0)) == payload(0) and disk.stats.hits == 1
    assert chain.locate(h(0)) == "host" and chain.locate(h(1)) == "disk" and host.hashes() == [h(2), h(0)]
    assert chain.get(h(0)) == payload(0) and host.stats.hits == 2 and disk.stats.hits == 1
    chain.flush(10)
    assert disk.contains(h(1)) and disk.contains(h(0))  # promotion copies, it does not move
    # Retention goes to the persistent tier, also for a block only the host tier holds.
    assert chain.retain(h(2), expires_at=2e9) and disk.contains(h(2))
    assert not chain.retain(h(7), expires_at=2e9)
    chain.close()


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def block_bytes(hf_model) -> int:
    return BlockCopier(tiny_engine(hf_model, block_size=BS, num_blocks=2).runner.kv_caches).payload_bytes


def test_evicted_prefix_is_restored_from_host_with_recompute_outputs(hf_model):
    p = prompt(0)
    reference = tiny_engine(hf_model, block_size=BS, num_blocks=64, enable_prefix_caching=False).generate([p], PARAMS)[0]
    slots = 64
    engine = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_offload_gib=slots * block_bytes(hf_model) / 2**30)
    assert engine.offloader is not None and engine.offloader.tier.name == "host"
    assert not engine.info.has_disk_tier  # 24h retention still needs the disk tier
    first = engine.generate([p], PARAMS)[0]
    flood(engine)
    assert engine.kv_cache.get_computed_blocks(p)[1] == 0  # gone from the device pool
    again = engine.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == (len(p) - 1) // BS * BS
    assert_same(first, reference)
    assert_same(again, reference)
    stats = engine.scheduler.stats
    assert stats.tier_hits["host"] == again.num_cached_tokens and stats.tier_hits["disk"] == 0
    host = engine.offloader.tier
    from server.cache_metrics import KVTierCollector
    collector = KVTierCollector("m", engine.info)
    collector.update(engine.stats())
    samples = {(s.name, s.labels.get("tier")): s.value for f in collector.collect() for s in f.samples}
    assert samples[("kvserve_kv_tier_hits_total", "host")] == again.num_cached_tokens
    assert samples[("kvserve_kv_tier_read_bytes_total", "host")] == 10 * host.block_bytes
    assert samples[("kvserve_kv_tier_usage_bytes", "host")] == host.usage_bytes() > 0
    assert samples[("kvserve_kv_tier_capacity_bytes", "host")] == slots * host.block_bytes
    assert samples[("kvserve_kv_offload_write_seconds_count", "host")] > 0
    assert samples[("kvserve_kv_tier_hits_total", "disk")] == 0
    # LRU within capacity: a flood of more blocks than the arena holds fills it, and no more.
    flood(engine, 8)
    assert host.stats.bytes_written > host.capacity_bytes() and host.usage_bytes() == host.capacity_bytes()
    assert_idle(engine)
    engine.close()


def test_host_then_disk_chain_serves_a_prefix_pushed_down_to_disk(hf_model, tmp_path):
    p = prompt(0)
    reference = tiny_engine(hf_model, block_size=BS, num_blocks=64, enable_prefix_caching=False).generate([p], PARAMS)[0]
    engine = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01,
                         kv_offload_gib=12 * block_bytes(hf_model) / 2**30)
    assert [t.name for t in engine.offloader.tier.members] == ["host", "disk"] and engine.info.has_disk_tier
    engine.generate([p], PARAMS)
    flood(engine)  # p's blocks leave the pool, enter the host tier, and the flood pushes them on to disk
    flood(engine, 6)
    engine.offloader.tier.flush(10)
    host, disk = engine.offloader.tier.members
    assert disk.num_entries() > 0
    stats = engine.scheduler.stats
    hits0, queries0 = dict(stats.tier_hits), dict(stats.tier_queries)
    again = engine.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == 40
    assert_same(again, reference)
    hits = {t: stats.tier_hits[t] - hits0[t] for t in hits0}
    queries = {t: stats.tier_queries[t] - queries0[t] for t in queries0}
    assert hits["device"] == 0 and hits["disk"] > 0 and hits["host"] + hits["disk"] == 40
    assert queries["host"] == len(p) and queries["disk"] == len(p) - hits["host"]
    assert_idle(engine)
    engine.close()
    # close() spilled the host tier and the pool to disk: a restart finds the prefix there.
    restarted = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    third = restarted.generate([p], PARAMS)[0]
    assert third.num_cached_tokens == 40
    assert_same(third, reference)
    assert_idle(restarted)
    restarted.close()


def test_disk_hit_is_promoted_so_the_next_eviction_then_hit_is_served_from_host(hf_model, tmp_path):
    """A restarted engine (empty host tier) serves a prefix from disk; that read also writes the
    blocks into the host tier, so after the pool evicts them again the next hit comes from host
    (the offloader does not re-offload a block the chain already holds, so without promotion it
    would be read from disk every time). Tokens and logprobs equal recompute; nothing leaks."""
    p = prompt(0)
    reference = tiny_engine(hf_model, block_size=BS, num_blocks=64, enable_prefix_caching=False).generate([p], PARAMS)[0]
    seed = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    seed.generate([p], PARAMS)
    seed.close()  # spills the pool to disk
    engine = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01,
                         kv_offload_gib=128 * block_bytes(hf_model) / 2**30)
    host, disk = engine.offloader.tier.members
    assert host.num_entries() == 0
    stats = engine.scheduler.stats
    first = engine.generate([p], PARAMS)[0]
    assert first.num_cached_tokens == 40 and stats.tier_hits["disk"] == 40 and stats.tier_hits["host"] == 0
    promoted = host.hashes()
    assert len(promoted) == 10 and all(disk.contains(x) for x in promoted)
    flood(engine)  # 60 blocks: the arena (128 slots) keeps p's 10
    assert engine.kv_cache.get_computed_blocks(p)[1] == 0  # gone from the device pool
    assert all(engine.offloader.tier.locate(x) == "host" for x in promoted)
    disk_reads = disk.stats.hits
    again = engine.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == 40
    assert stats.tier_hits["host"] == 40 and stats.tier_hits["disk"] == 40  # the second hit: host only
    assert disk.stats.hits == disk_reads
    from server.cache_metrics import KVTierCollector
    collector = KVTierCollector("m", engine.info)
    collector.update(engine.stats())
    samples = {(s.name, s.labels.get("tier")): s.value for f in collector.collect() for s in f.samples}
    assert samples[("kvserve_kv_tier_hits_total", "host")] == 40
    assert samples[("kvserve_kv_tier_hits_total", "disk")] == 40
    assert samples[("kvserve_kv_tier_read_bytes_total", "disk")] == 10 * host.block_bytes
    assert_same(first, reference)
    assert_same(again, reference)
    assert_idle(engine)
    engine.close()
