"""Moving KV blocks between the device pool and a lower tier (cache/tiers.py).

``BlockCopier`` turns one block of every layer's K and V into bytes and back (the tier stores
bytes only). ``KVOffloader`` drives a tier for the engine:

* ``offload``: called right after ``schedule()`` and before the forward pass, with the blocks the
  pool evicted or asked to write through; it copies them out (a memcpy) and hands the bytes to
  the tier, whose writer thread does the disk I/O - the step never waits on the disk;
* ``submit_load``: reads a request's tier blocks on a reader thread;
* ``poll``: on the engine thread, copies finished reads into their pool blocks and returns
  ``(request_id, blocks loaded)``; a read that failed (miss, corrupt file) ends that request's
  load at the block before it;
* ``spill``: at shutdown, writes what the pool and the host tier cache to the disk tier.

Only the engine thread touches the pool tensors.
"""
from __future__ import annotations

import hashlib
import logging
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from cache.hashing import BlockHash
from cache.tiers import HostTier, KVTier, tier_members

logger = logging.getLogger(__name__)


class BlockCopier:
    """Serializes block ``i`` of every layer's K and V pool (layer order, K then V) to bytes."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        # int8 pools (engine/kv/int8.py) travel as their codes and their scales.
        self.tensors = [t for pair in kv_caches for c in pair
                        for t in (c.tensors() if hasattr(c, "tensors") else [c])]
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        # int4 pools (engine/kv/int4.py): a block written here is quantized, never an open block.
        self.residuals = list({id(c.state): c.state for pair in kv_caches for c in pair if hasattr(c, "state")}.values())
        self.payload_bytes = sum(self.block_bytes)

    def read_block(self, block_id: int) -> bytes:
        parts = [t[block_id].reshape(-1).view(torch.uint8) for t in self.tensors]
        return torch.cat(parts).cpu().numpy().tobytes()

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [self.read_block(b) for b in block_ids]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        for block_id, payload in zip(block_ids, payloads):
            self.write_block(block_id, payload)

    def write_block(self, block_id: int, payload: bytes) -> None:
        """ValueError (nothing written) if the payload does not have this pool's block size."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"block payload has {len(payload)} bytes, expected {self.payload_bytes}")
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t, n in zip(self.tensors, self.block_bytes):
            src = flat[offset:offset + n].view(t.dtype).view(t[block_id].shape)
            t[block_id].copy_(src.to(t.device))
            offset += n
        for residual in self.residuals:
            residual.release(block_id)


def model_fingerprint(state_dict: dict[str, torch.Tensor], *, model_dtype: str, kv_dtype: str,
                      block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      sample_bytes: int = 1 << 16) -> bytes:
    """A sha256 naming the weights (names, shapes, dtypes and a strided sample of each tensor's
    bytes), the compute and KV dtypes and the pool geometry: tier files of another model, dtype
    or block size never match it."""
    h = hashlib.sha256()
    h.update(f"kvserve-kv-v1|{model_dtype}|{kv_dtype}|{block_size}|{num_layers}|{num_kv_heads}|{head_dim}".encode())
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        h.update(f"|{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if flat.numel() > sample_bytes:
            step = flat.numel() // sample_bytes
            flat = flat[::step][:sample_bytes]
        h.update(flat.cpu().numpy().tobytes())
    return h.digest()


class KVOffloader:
    def __init__(self, tier: KVTier, copier: BlockCopier) -> None:
        self.tier = tier
        self.copier = copier
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tier-read")
        self._loads: dict[Future, tuple[str, list[int]]] = {}

    def offload(self, items: list[tuple[int, BlockHash, float]]) -> int:
        """Copy ``(block_id, hash, expires_at)`` blocks out now and queue them for the tier;
        blocks already in the tier are only re-dated. Returns the blocks queued."""
        todo = []
        for block_id, block_hash, expires_at in items:
            if self.tier.contains(block_hash):
                if expires_at > 0:
                    self.tier.retain(block_hash, expires_at)
                continue
            todo.append((block_id, block_hash, expires_at))
        # One batched copy (with tensor parallelism: one gather over the ranks, not one per block).
        payloads = self.copier.read_blocks([block_id for block_id, _, _ in todo]) if todo else []
        for (_, block_hash, expires_at), payload in zip(todo, payloads):
            self.tier.put(block_hash, payload, expires_at)
        return len(todo)

    def submit_load(self, request_id: str, blocks: list[tuple[int, BlockHash]]) -> None:
        hashes = [h for _, h in blocks]
        future = self._reader.submit(self._read_chain, hashes)
        self._loads[future] = (request_id, [block_id for block_id, _ in blocks])

    def _read_chain(self, hashes: list[BlockHash]) -> list[bytes]:
        payloads = []
        for block_hash in hashes:
            payload = self.tier.get(block_hash)
            if payload is None or len(payload) != self.copier.payload_bytes:
                break
            payloads.append(payload)
        return payloads

    @property
    def num_pending_loads(self) -> int:
        return len(self._loads)

    def poll(self, timeout: float = 0.0, is_live=lambda request_id: True) -> list[tuple[str, int]]:
        """Apply finished reads to the pool (engine thread only); ``(request_id, blocks loaded)``.

        ``timeout`` > 0 waits that long for the first read to finish. Reads of requests that
        ``is_live`` rejects (aborted meanwhile: their blocks may belong to someone else now) are
        discarded.
        """
        if not self._loads:
            return []
        if timeout > 0:
            wait(list(self._loads), timeout=timeout, return_when=FIRST_COMPLETED)
        finished = []
        for future in [f for f in self._loads if f.done()]:
            request_id, block_ids = self._loads.pop(future)
            try:
                payloads = future.result()
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a crash
                logger.exception("KV tier read failed for %s", request_id)
                payloads = []
            if not is_live(request_id):
                continue
            if payloads:
                self.copier.write_blocks(block_ids[:len(payloads)], payloads)
            finished.append((request_id, len(payloads)))
        return finished

    def spill(self, cached: list[tuple[BlockHash, int]], disk: KVTier | None) -> None:
        """Before a shutdown: write the pool's ``cached`` blocks ``(hash, block_id)`` and the host
        tier's blocks to the persistent tier ``disk``, so a restart finds every prefix, not only
        the evicted ones (without a host tier: through ``offload``; a block already there is only
        skipped)."""
        if disk is not None and disk is not self.tier:  # host -> disk: spill both to disk
            for tier in tier_members(self.tier):
                if isinstance(tier, HostTier):
                    for block_hash in tier.hashes():
                        payload = tier.peek(block_hash)
                        if payload is not None and not disk.contains(block_hash):
                            disk.put(block_hash, payload)
            missing = [(h, block_id) for h, block_id in cached if not disk.contains(h)]
            payloads = self.copier.read_blocks([b for _, b in missing]) if missing else []
            for (block_hash, _), payload in zip(missing, payloads):
                disk.put(block_hash, payload)
        else:
            self.offload([(block_id, block_hash, 0.0) for block_hash, block_id in cached])

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self.tier.close()
