"""Lower KV-cache tiers: where hashed blocks go when the device pool evicts them.

A tier stores opaque bytes (one block's K/V of every layer, serialized by the engine) under a
block hash; it never sees tensors. Tiers sit behind one interface (``KVTier``); the engine
builds the ones its config enables (engine/builder.py). The device pool itself is tier 0 and
lives in ``BlockPool``.

``DiskTier`` contract:
  * a file is named ``sha256(fingerprint || block_hash).hex() + ".kvb"`` - never anything a
    request supplies - so a request can neither pick nor escape the folder;
  * each file carries a header (magic, fingerprint, block hash, expiry, payload length, sha256 of
    the payload); a short, corrupt or foreign file is a miss (and is deleted), never bytes
    returned for the wrong block;
  * the block hash already carries the tenant's cache salt (block 0 of the chain), and the
    fingerprint names the weights, dtypes, block size and KV dtype, so two models or two
    tenants never share an entry;
  * ``put`` returns at once: one writer thread writes a temporary file and renames it into
    place; until then ``get`` serves the pending bytes from memory;
  * LRU within ``capacity_bytes``; an entry whose ``expires_at`` (a retention deadline, wall
    clock) lies in the future is never evicted by LRU; a put that cannot fit is dropped;
  * a new ``DiskTier`` on the same folder finds the entries of the same fingerprint again.

``HostTier`` contract (``--kv-offload-gib``): a preallocated arena of fixed-size slots (one
block payload each) handed in by the engine (pinned memory when the pool is on a GPU, so the
copies to and from the device are DMA); ``put`` copies synchronously into a slot (a memcpy,
no I/O); LRU within the arena; an entry evicted from it goes to ``on_evict`` (the next tier),
not away; volatile (gone with the process); no retention protection of its own.

``TierChain`` puts the lower tiers in order (host -> disk) behind the one ``KVTier`` interface
the cache manager and the offloader see: a lookup finds a block in any member, a read tries them
in order (and promotes a block found lower down into the members above: a disk hit is also
written to the host tier), a put lands in the first and trickles down by LRU, and a retention
deadline is written through to the last (persistent) member.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cache.hashing import BlockHash

logger = logging.getLogger(__name__)

_MAGIC = b"KVSBLK01"
# magic, fingerprint, block hash, expires_at (unix seconds, 0 = none), payload length, payload sha256
_HEADER = struct.Struct("<8s32s32sdQ32s")
_SUFFIX = ".kvb"
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


@dataclass
class _Entry:
    size: int  # bytes on the medium (header + payload)
    expires_at: float = 0.0


class DiskTier:
    """Block files in one folder, LRU within a byte budget; see the module docstring."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, fingerprint: bytes,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes} bytes")
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes (a sha256 digest)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._capacity = int(capacity_bytes)
        self.fingerprint = fingerprint
        self.clock = clock
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU first
        self._pending: dict[BlockHash, tuple[bytes, float]] = {}  # accepted, not yet on disk
        self._used = 0
        self._queue: queue.Queue[BlockHash | None] = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-tier", daemon=True)
        self._writer.start()

    # ---- naming and the file format ------------------------------------------------------
    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / (hashlib.sha256(self.fingerprint + block_hash).hexdigest() + _SUFFIX)

    def _encode(self, block_hash: BlockHash, payload: bytes, expires_at: float) -> bytes:
        header = _HEADER.pack(_MAGIC, self.fingerprint, block_hash, expires_at, len(payload),
                              hashlib.sha256(payload).digest())
        return header + payload

    def _scan(self) -> None:
        """Index the folder's files of this fingerprint, oldest modification first (LRU order)."""
        found = []
        for path in self.directory.glob("*" + _SUFFIX):
            try:
                with open(path, "rb") as f:
                    raw = f.read(_HEADER.size)
                stat = path.stat()
            except OSError:
                continue
            if len(raw) != _HEADER.size:
                continue
            magic, fingerprint, block_hash, expires_at, length, _ = _HEADER.unpack(raw)
            if magic != _MAGIC or fingerprint != self.fingerprint or path != self._path(block_hash):
                continue  # another model's (or a stray) file: not ours to count or delete
            found.append((stat.st_mtime, block_hash, _Entry(stat.st_size, expires_at)))
        for _, block_hash, entry in sorted(found, key=lambda item: item[0]):
            self._entries[block_hash] = entry
            self._used += entry.size
        with self._lock:
            self._evict_locked(0)

    # ---- KVTier ------------------------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pending or block_hash in self._entries

    def get(self, block_hash: BlockHash) -> bytes | None:
        start = time.perf_counter()
        with self._lock:
            self.stats.queries += 1
            pending = self._pending.get(block_hash)
            if pending is not None:
                self.stats.hits += 1
                self.stats.bytes_read += len(pending[0])
                return pending[0]
            if block_hash not in self._entries:
                return None
            self._entries.move_to_end(block_hash)
        payload = self._read(block_hash)
        with self._lock:
            if payload is None:
                self.stats.corrupt += 1
                self._forget_locked(block_hash, delete=True)
                return None
            self.stats.hits += 1
            self.stats.bytes_read += len(payload)
            self.stats.observe("read", time.perf_counter() - start)
        return payload

    def _read(self, block_hash: BlockHash) -> bytes | None:
        try:
            raw = self._path(block_hash).read_bytes()
        except OSError:
            return None
        if len(raw) < _HEADER.size:
            return None
        magic, fingerprint, stored_hash, _, length, digest = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size:]
        if (magic != _MAGIC or fingerprint != self.fingerprint or stored_hash != block_hash
                or length != len(payload) or hashlib.sha256(payload).digest() != digest):
            logger.warning("disk tier: discarding a corrupt or foreign block file %s", self._path(block_hash).name)
            return None
        return payload

    def put(self, block_hash: BlockHash, payload: bytes, expires_at: float = 0.0) -> None:
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None or block_hash in self._pending:
                if entry is not None and expires_at > entry.expires_at:
                    # Rewrite so the new deadline survives a restart.
                    self._pending[block_hash] = (payload, expires_at)
                    self._queue.put(block_hash)
                return
            self._pending[block_hash] = (payload, expires_at)
        self._queue.put(block_hash)

    def retain(self, block_hash: BlockHash, expires_at: float) -> bool:
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                if expires_at > pending[1]:
                    self._pending[block_hash] = (pending[0], expires_at)
                return True
            if block_hash not in self._entries:
                return False
        payload = self.get(block_hash)
        if payload is None:
            return False
        self.put(block_hash, payload, expires_at)
        return True

    def usage_bytes(self) -> int:
        with self._lock:
            return self._used

    def capacity_bytes(self) -> int:
        return self._capacity

    def num_entries(self) -> int:
        with self._lock:
            return len(self._entries)

    def flush(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("disk tier writes still pending")
            time.sleep(0.002)

    def close(self) -> None:
        self.flush(timeout=30)
        self._queue.put(None)
        self._writer.join(timeout=5)

    # ---- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            if block_hash is None:
                return
            with self._lock:
                pending = self._pending.get(block_hash)
            if pending is None:
                continue
            payload, expires_at = pending
            start = time.perf_counter()
            data = self._encode(block_hash, payload, expires_at)
            path = self._path(block_hash)
            try:
                with self._lock:
                    old = self._entries.get(block_hash)
                    if old is None and not self._evict_locked(len(data)):
                        self.stats.writes_dropped += 1
                        del self._pending[block_hash]
                        continue
                tmp = path.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except OSError:
                logger.exception("disk tier: writing %s failed", path.name)
                with self._lock:
                    self.stats.writes_dropped += 1
                    if self._pending.get(block_hash) is pending:
                        del self._pending[block_hash]
                continue
            with self._lock:
                old = self._entries.pop(block_hash, None)
                if old is not None:
                    self._used -= old.size
                self._entries[block_hash] = _Entry(len(data), expires_at)
                self._used += len(data)
                self.stats.bytes_written += len(payload)
                self.stats.observe("write", time.perf_counter() - start)
                if self._pending.get(block_hash) is pending:
                    del self._pending[block_hash]

    def _evict_locked(self, incoming: int) -> bool:
        """Drop least recently used unprotected entries until ``incoming`` more bytes fit."""
        if self._used + incoming <= self._capacity:
            return True
        now = self.clock()
        for block_hash in list(self._entries):
            if self._used + incoming <= self._capacity:
                break
            if self._entries[block_hash].expires_at > now:
                continue
            self._forget_locked(block_hash, delete=True)
        return self._used + incoming <= self._capacity

    def _forget_locked(self, block_hash: BlockHash, delete: bool) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self._used -= entry.size
        if delete:
            try:
                self._path(block_hash).unlink()
            except OSError:
                pass


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


class TierChain:
    """The lower tiers in order (e.g. host -> disk) as one ``KVTier``; see the module docstring.
    ``members`` are the tiers themselves (the engine reads their own stats for the metrics)."""

    name = "chain"

    def __init__(self, members: list[KVTier]) -> None:
        if len(members) < 2:
            raise ValueError("a tier chain needs at least two tiers")
        self.members = members
        self.stats = TierStats()  # unused: the members' own stats are reported
        for upper, lower in zip(members, members[1:]):
            if isinstance(upper, HostTier):
                upper.on_evict = lambda h, payload, lower=lower: lower.put(h, payload)

    def locate(self, block_hash: BlockHash) -> str | None:
        """The name of the first tier holding the block, or None."""
        return next((t.name for t in self.members if t.contains(block_hash)), None)

    def contains(self, block_hash: BlockHash) -> bool:
        return any(t.contains(block_hash) for t in self.members)

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The payload from the first member that holds it; a block served from a lower member
        (disk) is promoted into the members above it (host), so that after the device pool
        evicts it again the next hit is served from the faster tier: the offloader skips a
        block the chain already holds, so without this it would stay on disk only."""
        for index, tier in enumerate(self.members):
            if tier.contains(block_hash):
                payload = tier.get(block_hash)
                if payload is not None:
                    for upper in self.members[:index]:
                        upper.put(block_hash, payload)
                    return payload
        return None

    def put(self, block_hash: BlockHash, payload: bytes, expires_at: float = 0.0) -> None:
        self.members[0].put(block_hash, payload, expires_at)
        if expires_at > 0:  # retention is the persistent tier's job
            self.members[-1].put(block_hash, payload, expires_at)

    def retain(self, block_hash: BlockHash, expires_at: float) -> bool:
        last = self.members[-1]
        if last.retain(block_hash, expires_at):
            return True
        for tier in self.members[:-1]:
            payload = tier.peek(block_hash) if isinstance(tier, HostTier) else None
            if payload is not None:
                last.put(block_hash, payload, expires_at)
                return True
        return False

    def usage_bytes(self) -> int:
        return sum(t.usage_bytes() for t in self.members)

    def capacity_bytes(self) -> int:
        return sum(t.capacity_bytes() for t in self.members)

    def flush(self, timeout: float | None = None) -> None:
        for tier in self.members:
            tier.flush(timeout)

    def close(self) -> None:
        for tier in self.members:
            tier.close()


def tier_members(tier: KVTier | None) -> list[KVTier]:
    """The individual tiers behind ``tier`` (a chain's members, or the tier itself), top first."""
    if tier is None:
        return []
    return list(tier.members) if isinstance(tier, TierChain) else [tier]
