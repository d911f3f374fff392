"""DiskTier on its own: format checks, LRU within capacity, retention, asynchronous writes."""
from __future__ import annotations

import hashlib

from cache.tiers import DiskTier

FP = hashlib.sha256(b"model-a").digest()


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


class Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_roundtrip_restart_and_foreign_fingerprint(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, FP)
    tier.put(key(1), b"abc" * 100)
    assert tier.contains(key(1)) and tier.get(key(1)) == b"abc" * 100  # served before or after the write
    tier.close()
    names = [p.name for p in tmp_path.iterdir()]
    assert names == [hashlib.sha256(FP + key(1)).hexdigest() + ".kvb"]  # named by hashes only
    again = DiskTier(tmp_path, 1 << 20, FP)
    assert again.get(key(1)) == b"abc" * 100 and again.stats.hits == 1
    other = DiskTier(tmp_path, 1 << 20, hashlib.sha256(b"model-b").digest())
    assert not other.contains(key(1)) and other.get(key(1)) is None
    again.close(), other.close()
    assert len(list(tmp_path.iterdir())) == 1  # a foreign tier leaves others' files alone


def test_corrupt_file_is_a_miss_and_removed(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, FP)
    tier.put(key(1), bytes(range(256)))
    tier.flush(10)
    path = tier._path(key(1))
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    assert tier.get(key(1)) is None
    assert not path.exists() and not tier.contains(key(1)) and tier.stats.corrupt == 1
    # A file renamed to another hash's name (header names a different block) is a miss too.
    tier.put(key(2), b"x" * 10)
    tier.put(key(3), b"y" * 10)
    tier.flush(10)
    tier._path(key(2)).replace(tier._path(key(3)))
    assert tier.get(key(3)) is None
    tier.close()


def test_lru_within_capacity_and_retention_is_not_evicted(tmp_path):
    clock = Clock()
    payload = b"z" * 1000
    tier = DiskTier(tmp_path, 3 * 1200, FP, clock=clock)  # room for 3 entries (payload + header)
    tier.put(key(0), payload, expires_at=clock.now + 24 * 3600)  # retained for 24h
    for i in (1, 2):
        tier.put(key(i), payload)
        tier.flush(10)
    assert tier.get(key(1)) == payload  # 1 is now more recent than 2
    tier.put(key(3), payload)
    tier.flush(10)
    assert tier.contains(key(1)) and not tier.contains(key(2))  # LRU evicted 2, never the retained 0
    for i in range(4, 8):
        tier.put(key(i), payload)
        tier.flush(10)
    assert tier.contains(key(0))  # the retained entry outlives a flood
    assert tier.usage_bytes() <= tier.capacity_bytes()
    assert tier.num_entries() == 3
    clock.now += 25 * 3600  # retention over: now an ordinary LRU entry
    for i in range(8, 11):
        tier.put(key(i), payload)
        tier.flush(10)
    assert not tier.contains(key(0))
    tier.close()
