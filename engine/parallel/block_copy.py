"""KV block copies for the tiers (cache/tiers.py) when the pool is split over tensor-parallel ranks.

Each rank's pool holds its own KV heads (``[num_blocks, block_size, KV/N, last]`` per tensor:
K and V of every layer, and an int8 pool's scales). A tier payload must hold every head, and it
has exactly the single-rank layout of ``engine.kv.transfer.BlockCopier`` (each tensor's block
``[block_size, KV, last]`` in layer order, K then V, codes then scales), so the files of a TP=1
and a TP=N engine of the same model are interchangeable (the fingerprint names the full head
count, not the split).

- read: rank 0 broadcasts the block ids; every rank flattens its blocks' head slices, and one
  gloo gather brings them to rank 0, which puts each tensor's heads back together.
- write: rank 0 broadcasts the block ids, splits the payloads by heads and scatters each rank
  its own slice (the payload bytes cross the wire once, not once per rank); every rank copies
  its slice into its pool with one ``index_copy_`` per tensor.

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


def local_bytes(tensors: list[torch.Tensor], num_blocks: int) -> int:
    """Bytes of one rank's slices of ``num_blocks`` blocks (what ``read_local`` returns)."""
    return num_blocks * sum(t[0].numel() * t.element_size() for t in tensors)


def _as(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 bytes -> a ``dtype`` tensor of ``shape`` (copied first when the bytes are not
    aligned for ``dtype``, e.g. float32 scales after an odd number of int8 codes)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if flat.storage_offset() % itemsize or not flat.is_contiguous():
        flat = flat.clone()
    return flat.view(dtype).view(shape)


def read_local(tensors: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """This rank's slices of ``block_ids``, as one flat uint8 CPU tensor (tensor-major)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    parts = [t.index_select(0, index).reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts).cpu()


def assemble(flats: list[torch.Tensor], tensors: list[torch.Tensor], num_blocks: int) -> list[bytes]:
    """Rank-ordered ``read_local`` outputs -> one full-head payload per block."""
    columns = []  # per tensor: [num_blocks, its full-head block bytes]
    offset = 0
    for t in tensors:
        n = num_blocks * t[0].numel() * t.element_size()
        shape = (num_blocks, *t.shape[1:])
        full = torch.cat([_as(f[offset:offset + n], t.dtype, shape) for f in flats], dim=HEAD_DIM_INDEX)
        columns.append(full.reshape(num_blocks, -1).view(torch.uint8))
        offset += n
    rows = torch.cat(columns, dim=1)
    return [rows[i].numpy().tobytes() for i in range(num_blocks)]


def split_payloads(payloads: list[bytes], tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Full-head payloads -> one flat uint8 tensor per rank, in ``read_local``'s layout."""
    n = len(payloads)
    rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(n, -1)
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    offset = 0
    for t, nbytes in zip(tensors, full_block_bytes(tensors, world)):
        heads = t.shape[HEAD_DIM_INDEX]
        full = rows[:, offset:offset + nbytes].contiguous().view(t.dtype).view(n, t.shape[1], heads * world,
                                                                               *t.shape[3:])
        for r in range(world):
            per_rank[r].append(full[:, :, r * heads:(r + 1) * heads].contiguous().view(-1).view(torch.uint8))
        offset += nbytes
    return [torch.cat(parts) for parts in per_rank]


def write_local(tensors: list[torch.Tensor], block_ids: list[int], flat: torch.Tensor) -> None:
    """Copy this rank's slices (``split_payloads``' entry for it) into ``block_ids``."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
    offset = 0
    for t in tensors:
        n = len(block_ids) * t[0].numel() * t.element_size()
        t.index_copy_(0, index, _as(flat[offset:offset + n], t.dtype, (len(block_ids), *t.shape[1:])).to(t.device))
        offset += n


class RankBlockCopier:
    """``BlockCopier``'s interface (``payload_bytes``, ``read_block(s)``, ``write_block(s)``)
    over the pools of every tensor-parallel rank; ``ranks`` is rank 0's ``TensorParallelRanks``."""

    def __init__(self, ranks, kv_caches: list) -> None:  # noqa: ANN001 - TensorParallelRanks (no import cycle)
        self.ranks = ranks
        self.kv_caches = kv_caches
        self.tensors = pool_tensors(kv_caches)
        self.payload_bytes = sum(full_block_bytes(self.tensors, ranks.group.world_size))

    def read_block(self, block_id: int) -> bytes:
        return self.read_blocks([block_id])[0]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """One broadcast and one gather for all of ``block_ids``."""
        return self.ranks.read_kv_blocks(self.kv_caches, list(block_ids))

    def write_block(self, block_id: int, payload: bytes) -> None:
        self.write_blocks([block_id], [payload])

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """ValueError (nothing written, on any rank) if a payload is not one full block."""
        for payload in payloads:
            if len(payload) != self.payload_bytes:
                raise ValueError(f"block payload has {len(payload)} bytes, expected {self.payload_bytes}")
        self.ranks.write_kv_blocks(self.kv_caches, list(block_ids), list(payloads))
