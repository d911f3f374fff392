"""The disk tier on the real engine (tiny random Llama): a prefix restored from disk computes
the same tokens and logits as recomputing it, survives a restart, and a bad file is a miss."""
from __future__ import annotations

import random

import pytest

from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model

BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def prompt(seed: int, n: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def disk_engine(hf_model, folder, num_blocks: int = 24):
    return tiny_engine(hf_model, block_size=BS, num_blocks=num_blocks, kv_disk_dir=str(folder), kv_disk_gib=0.01)


def flood(engine, n: int = 4) -> None:
    """Distinct prompts that evict everything cached in a 24-block pool."""
    engine.generate([prompt(1000 + i, 60) for i in range(n)], SamplingParams(temperature=0.0, max_tokens=2))


def assert_idle(engine) -> None:
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0
    assert not engine.scheduler.loading


def assert_same(result, reference) -> None:
    assert result.token_ids == reference.token_ids
    for got, want in zip(result.logprobs, reference.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in want.top], abs=1e-4)


def test_evicted_prefix_is_restored_from_disk_with_recompute_outputs(hf_model, tmp_path):
    p = prompt(0)
    reference = tiny_engine(hf_model, block_size=BS, num_blocks=64, enable_prefix_caching=False).generate([p], PARAMS)[0]
    engine = disk_engine(hf_model, tmp_path)
    first = engine.generate([p], PARAMS)[0]
    assert first.num_cached_tokens == 0
    flood(engine)
    assert engine.kv_cache.get_computed_blocks(p)[1] == 0  # gone from the device pool
    engine.offloader.tier.flush(10)
    computed_before = engine.runner.num_tokens_computed
    again = engine.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == (len(p) - 1) // BS * BS  # all full blocks but the last token's
    # Only the uncached tail and the decode tokens went through the model.
    assert engine.runner.num_tokens_computed - computed_before == len(p) - again.num_cached_tokens + 7
    assert_same(first, reference)
    assert_same(again, reference)
    assert engine.scheduler.stats.tier_hits["disk"] == again.num_cached_tokens
    assert_idle(engine)
    # The tier metrics see it: disk hits, bytes read and written, a read latency observation.
    # (fed the core's snapshots: counters as deltas, so a second snapshot adds nothing)
    from server.cache_metrics import KVTierCollector
    collector = KVTierCollector("m", engine.info)
    collector.update(engine.stats())
    collector.update(engine.stats())
    samples = {(s.name, s.labels.get("tier")): s.value for f in collector.collect() for s in f.samples}
    assert samples[("kvserve_kv_tier_hits_total", "disk")] == 40
    assert samples[("kvserve_kv_tier_read_bytes_total", "disk")] == 10 * engine.offloader.copier.payload_bytes
    assert samples[("kvserve_kv_tier_written_bytes_total", "disk")] > 0
    assert samples[("kvserve_kv_offload_read_seconds_count", "disk")] == 10
    assert samples[("kvserve_kv_tier_usage_bytes", "disk")] > 0
    engine.close()


def test_disk_tier_survives_a_restart_and_a_corrupt_file_is_a_miss(hf_model, tmp_path):
    p, q = prompt(1), prompt(2)
    engine = disk_engine(hf_model, tmp_path)
    refs = engine.generate([p, q], PARAMS)
    flood(engine)
    engine.close()
    files = sorted(tmp_path.glob("*.kvb"))
    assert files and not list(tmp_path.glob("*.tmp"))

    restarted = disk_engine(hf_model, tmp_path)
    again = restarted.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == 40
    assert_same(again, refs[0])
    assert_idle(restarted)
    restarted.close()

    # Corrupt every file of q's chain: flip a payload byte (checksum) or truncate.
    fresh = disk_engine(hf_model, tmp_path)
    from cache.hashing import hash_full_blocks
    chain = hash_full_blocks(q[:40], BS)
    for i, block_hash in enumerate(chain):
        path = fresh.offloader.tier._path(block_hash)
        data = bytearray(path.read_bytes())
        if i % 2:
            data[-1] ^= 0xFF
        else:
            data = data[:len(data) // 2]
        path.write_bytes(bytes(data))
    bad = fresh.generate([q], PARAMS)[0]
    assert bad.num_cached_tokens == 0  # the first block is unreadable: the whole chain is a miss
    assert_same(bad, refs[1])
    assert fresh.offloader.tier.stats.corrupt >= 1
    assert_idle(fresh)
    fresh.close()


def test_foreign_fingerprint_is_a_miss(hf_model, tmp_path):
    p = prompt(3)
    engine = disk_engine(hf_model, tmp_path)
    engine.generate([p], PARAMS)
    flood(engine)
    engine.close()
    other = tiny_engine(tiny_hf_model(seed=1), block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path),
                        kv_disk_gib=0.01)
    assert other.offloader.tier.num_entries() == 0
    assert other.generate([p], PARAMS)[0].num_cached_tokens == 0
    assert_idle(other)
    other.close()


def test_24h_retention_writes_through_and_outlives_the_disk_lru(hf_model, tmp_path):
    from kvtypes.cache_policy import CachePolicy

    p = prompt(4)
    # Room for ~16 blocks on disk (2 KiB of KV + a header each): a flood would push p out.
    engine = tiny_engine(hf_model, block_size=BS, num_blocks=24, kv_disk_dir=str(tmp_path),
                         kv_disk_gib=36_000 / 2**30)
    retained = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                              cache_policy=CachePolicy(retention_s=24 * 3600.0))
    first = engine.generate([p], retained)[0]
    assert first.num_cache_write_tokens == 40
    engine.offloader.tier.flush(10)
    assert engine.offloader.tier.num_entries() == 10  # written through at once, no eviction needed
    flood(engine, 6)
    engine.offloader.tier.flush(10)
    assert engine.offloader.tier.stats.bytes_written > 16 * 2048  # the flood did cycle the tier
    again = engine.generate([p], PARAMS)[0]
    assert again.num_cached_tokens == 40
    assert_same(again, first)
    assert_idle(engine)
    engine.close()


def test_loads_run_beside_the_batch_and_an_aborted_load_leaks_nothing(hf_model, tmp_path):
    p, q = prompt(5), prompt(6)
    engine = disk_engine(hf_model, tmp_path, num_blocks=40)
    refs = engine.generate([p, q], PARAMS)
    flood(engine, 6)
    engine.offloader.tier.flush(10)
    # Two requests on p's prefix at once (each loads its own copy) and one fresh request.
    fresh = prompt(7, 9)
    results = engine.generate([p, p, fresh], PARAMS)
    assert [r.num_cached_tokens for r in results] == [40, 40, 0]
    assert_same(results[0], refs[0])
    assert_same(results[1], refs[0])
    assert_idle(engine)
    # Abort q while its blocks are being loaded: the read is discarded, the blocks come back.
    flood(engine, 6)
    engine.offloader.tier.flush(10)
    rid = engine.add_request(q, PARAMS)
    engine.step()
    assert rid in engine.scheduler.loading
    engine.abort(rid)
    assert not engine.scheduler.loading
    other = engine.generate([prompt(8, 30)], PARAMS)[0]
    assert other.finish_reason == "length"
    engine.step()  # a stale read may complete now: it must be dropped
    assert engine.offloader.num_pending_loads == 0 or engine.offloader.poll(timeout=5) == []
    assert_idle(engine)
    engine.close()
