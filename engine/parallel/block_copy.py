"""KV block copies for the tiers (cache/tiers.py) when the pool is split over tensor-parallel ranks.

Each rank's pool holds its own KV heads (``[num_blocks, block_size, KV/N, last]`` per tensor:
K and V of every layer, and an int8 pool's scales). A tier payload must hold every head, and it
has exactly the single-rank layout of ``engine.kv_transfer.BlockCopier`` (each tensor's block
``[block_size, KV, last]`` in layer order, K then V, codes then scales), so the files of a TP=1
and a TP=N engine of the same model are interchangeable (the fingerprint names the full head
count, not the split).

- read: every rank flattens its blocks' head slices; one gloo all-gather brings them to rank 0,
  which concatenates each tensor's slices along the head dimension.
- write: rank 0 broadcasts the payloads; every rank copies its own heads' slice into its pool.

Rank 0 drives both from the engine thread (the same thread that runs the steps), so the
messages never interleave with a step's broadcast.
"""
from __future__ import annotations

import torch

HEAD_DIM_INDEX = 2  # [num_blocks, block_size, heads, last]


def pool_tensors(kv_caches: list) -> list[torch.Tensor]:
    """The pool's tensors in payload order (``BlockCopier``'s): per layer K then V, an int8
    pool as its codes then its scales."""
    return [t for pair in kv_caches for c in pair for t in (c.tensors() if hasattr(c, "tensors") else [c])]


def full_block_bytes(tensors: list[torch.Tensor], world: int) -> list[int]:
    """Bytes of one block of each tensor with every rank's heads."""
    return [t[0].numel() * t.element_size() * world for t in tensors]


def read_local(tensors: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """This rank's slices of ``block_ids``, as one flat uint8 CPU tensor (tensor-major)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    parts = [t.index_select(0, index).reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts).cpu()


def assemble(flats: list[torch.Tensor], tensors: list[torch.Tensor], num_blocks: int) -> list[bytes]:
    """Rank-ordered ``read_local`` outputs -> one full-head payload per block."""
    per_tensor = []  # each: [num_blocks, block_size, heads, last] with every rank's heads
    offset = 0
    for t in tensors:
        n = num_blocks * t[0].numel() * t.element_size()
        shape = (num_blocks, *t.shape[1:])
        per_tensor.append(torch.cat([f[offset:offset + n].view(t.dtype).view(shape) for f in flats],
                                    dim=HEAD_DIM_INDEX))
        offset += n
    return [torch.cat([p[i].reshape(-1).view(torch.uint8) for p in per_tensor]).numpy().tobytes()
            for i in range(num_blocks)]


def write_local(tensors: list[torch.Tensor], block_ids: list[int], payloads: list[bytes], rank: int,
                world: int) -> None:
    """Copy rank ``rank``'s heads of each full-head payload into its block."""
    sizes = full_block_bytes(tensors, world)
    for block_id, payload in zip(block_ids, payloads):
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t, n in zip(tensors, sizes):
            local_heads = t.shape[HEAD_DIM_INDEX]
            full = flat[offset:offset + n].view(t.dtype).view(t.shape[1], local_heads * world, *t.shape[3:])
            t[block_id].copy_(full[:, rank * local_heads:(rank + 1) * local_heads].to(t.device))
            offset += n


class RankBlockCopier:
    """``BlockCopier``'s interface (``payload_bytes``, ``read_block``, ``write_block``) over the
    pools of every tensor-parallel rank; ``model`` is rank 0's ``TensorParallelModel``."""

    def __init__(self, model, kv_caches: list) -> None:  # noqa: ANN001 - TensorParallelModel (no import cycle)
        self.model = model
        self.kv_caches = kv_caches
        self.tensors = pool_tensors(kv_caches)
        self.payload_bytes = sum(full_block_bytes(self.tensors, model.group.world_size))

    def read_block(self, block_id: int) -> bytes:
        return self.read_blocks([block_id])[0]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One broadcast and one gather for all of ``block_ids``."""
        return self.model.read_kv_blocks(self.kv_caches, list(block_ids))

    def write_block(self, block_id: int, payload: bytes) -> None:
        self.write_blocks([block_id], [payload])

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """ValueError (nothing written, on any rank) if a payload is not one full block."""
        for payload in payloads:
            if len(payload) != self.payload_bytes:
                raise ValueError(f"block payload has {len(payload)} bytes, expected {self.payload_bytes}")
        self.model.write_kv_blocks(self.kv_caches, list(block_ids), list(payloads))
