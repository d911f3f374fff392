"""``DiskTier``: the persistent tier, one file per block under a folder (contract in ``cache.tiers``)."""
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
from dataclasses import dataclass
from pathlib import Path

from cache.hashing import BlockHash
from cache.tiers.base import TierStats

logger = logging.getLogger(__name__)

_MAGIC = b"KVSBLK01"
# magic, fingerprint, block hash, expires_at (unix seconds, 0 = none), payload length, payload sha256
_HEADER = struct.Struct("<8s32s32sdQ32s")
_SUFFIX = ".kvb"


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
