"""What every lower tier is: the ``KVTier`` interface and its ``TierStats`` counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cache.hashing import BlockHash


# Latency histogram bucket bounds (seconds) for tier writes and reads.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    """Monotonic counters and latency histograms of one tier (read by the metrics collector).

    ``queries``/``hits`` count blocks looked up / found; bytes are payload bytes.
    Histogram lists are cumulative-free bucket counts aligned with ``LATENCY_BUCKETS`` + [+Inf].
    """

    queries: int = 0
    hits: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    writes_dropped: int = 0
    corrupt: int = 0
    write_seconds: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    write_seconds_sum: float = 0.0
    read_seconds: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    read_seconds_sum: float = 0.0
    # Raw observations not yet taken by ``drain_recent`` (the engine core ships them to the
    # frontend's histograms with each stats snapshot).
    recent_write_seconds: list[float] = field(default_factory=list)
    recent_read_seconds: list[float] = field(default_factory=list)

    def observe(self, kind: str, seconds: float) -> None:
        recent = self.recent_write_seconds if kind == "write" else self.recent_read_seconds
        if len(recent) < 65536:  # nobody drains an offline engine's: keep it bounded
            recent.append(seconds)
        buckets = self.write_seconds if kind == "write" else self.read_seconds
        index = next((i for i, bound in enumerate(LATENCY_BUCKETS) if seconds <= bound), len(LATENCY_BUCKETS))
        buckets[index] += 1
        if kind == "write":
            self.write_seconds_sum += seconds
        else:
            self.read_seconds_sum += seconds

    def drain_recent(self, kind: str) -> list[float]:
        """The observations of ``kind`` since the previous drain (safe against a concurrent
        ``observe``: a slice delete is atomic, and later appends stay for the next drain)."""
        recent = self.recent_write_seconds if kind == "write" else self.recent_read_seconds
        n = len(recent)
        taken = recent[:n]
        del recent[:n]
        return taken


class KVTier(Protocol):
    """A lower tier of the prefix cache. All methods are thread safe."""

    name: str
    stats: TierStats

    def contains(self, block_hash: BlockHash) -> bool:
        """True if ``get`` would very likely return the block (a later corrupt read is still a miss)."""
        ...

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The payload stored under ``block_hash``, or None (miss, corrupt, foreign)."""
        ...

    def put(self, block_hash: BlockHash, payload: bytes, expires_at: float = 0.0) -> None:
        """Store asynchronously; ``expires_at`` > now protects the entry from LRU until then."""
        ...

    def retain(self, block_hash: BlockHash, expires_at: float) -> bool:
        """Extend an existing entry's protection to ``expires_at``; False if absent."""
        ...

    def usage_bytes(self) -> int: ...

    def capacity_bytes(self) -> int: ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every accepted put is on the medium (tests, shutdown)."""
        ...

    def close(self) -> None: ...
