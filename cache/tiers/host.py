"""``HostTier``: fixed-size slots in a host-memory arena, LRU, spilling to the next tier (contract in ``cache.tiers``)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cache.hashing import BlockHash
from cache.tiers.base import TierStats


class HostTier:
    """Block payloads in a preallocated host arena, LRU; see the module docstring."""

    name = "host"

    def __init__(self, block_bytes: int, arena: memoryview | bytearray,
                 on_evict: Callable[[BlockHash, bytes], None] | None = None) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block payload size must be positive, got {block_bytes}")
        self.block_bytes = int(block_bytes)
        self._arena = memoryview(arena).cast("B")
        self._num_slots = len(self._arena) // self.block_bytes
        if self._num_slots == 0:
            raise ValueError(f"the host tier arena ({len(self._arena)} bytes) holds no block of {block_bytes} bytes")
        self.on_evict = on_evict
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> slot, LRU first
        self._free = list(range(self._num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def _slot(self, slot: int) -> memoryview:
        return self._arena[slot * self.block_bytes:(slot + 1) * self.block_bytes]

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._entries

    def hashes(self) -> list[BlockHash]:
        """The hashes held now, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def peek(self, block_hash: BlockHash) -> bytes | None:
        """The payload without counting a query or touching the LRU order (for the chain)."""
        with self._lock:
            slot = self._entries.get(block_hash)
            return None if slot is None else bytes(self._slot(slot))

    def get(self, block_hash: BlockHash) -> bytes | None:
        start = time.perf_counter()
        with self._lock:
            self.stats.queries += 1
            slot = self._entries.get(block_hash)
            if slot is None:
                return None
            self._entries.move_to_end(block_hash)
            payload = bytes(self._slot(slot))
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.observe("read", time.perf_counter() - start)
        return payload

    def put(self, block_hash: BlockHash, payload: bytes, expires_at: float = 0.0) -> None:
        start = time.perf_counter()
        evicted: tuple[BlockHash, bytes] | None = None
        with self._lock:
            if len(payload) != self.block_bytes:
                self.stats.writes_dropped += 1
                return
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return
            if self._free:
                slot = self._free.pop()
            else:
                old_hash, slot = self._entries.popitem(last=False)
                evicted = (old_hash, bytes(self._slot(slot)))
            self._slot(slot)[:] = payload
            self._entries[block_hash] = slot
            self.stats.bytes_written += len(payload)
            self.stats.observe("write", time.perf_counter() - start)
        if evicted is not None and self.on_evict is not None:
            self.on_evict(*evicted)

    def retain(self, block_hash: BlockHash, expires_at: float) -> bool:
        return self.contains(block_hash)  # the host tier is volatile: retention lives in the disk tier

    def usage_bytes(self) -> int:
        with self._lock:
            return len(self._entries) * self.block_bytes

    def capacity_bytes(self) -> int:
        return self._num_slots * self.block_bytes

    def num_entries(self) -> int:
        with self._lock:
            return len(self._entries)

    def flush(self, timeout: float | None = None) -> None:
        return None  # puts are synchronous

    def close(self) -> None:
        return None
