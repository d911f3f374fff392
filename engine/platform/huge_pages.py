"""Host buffers on transparent huge pages: the decode weights and the CPU KV pool.

Why: a decode step streams every weight once (SmolLM2 Q4_1: 97 MB) and each row's KV blocks,
and on 4 KiB pages every 4 KiB of that is a TLB miss; in a VM each miss is a two-level (guest
and host) page walk. On this project's 2-core Sapphire Rapids VM a core streaming 96 MB read
11.0-11.9 GB/s on 4 KiB pages and 16.4-18.5 GB/s on 2 MiB pages, two cores together 25.5
against 33.1 (`scripts/huge-page-read.c`; docs/benchmarks.md, "a twenty-third session").
torch's allocator asks for huge pages only under ``THP_MEM_ALLOC_ENABLE=1`` and only for
allocations of 2 MiB or more, and a model's packed matrices are mostly smaller (a SmolLM2
gate/up is 1.1 MB), so they are gathered into one buffer here.

A buffer is an anonymous private mapping, 2 MiB aligned, advised ``MADV_HUGEPAGE``: the kernel
backs it with huge pages where transparent huge pages are ``always`` or ``madvise`` (the usual
default) and with 4 KiB pages under ``never``. Its pages are zeros; ``zeros`` writes them at once
(the pool is committed at start, as torch.zeros did), ``slots`` as the copies fill them. Where the
platform has no such mapping (not Linux), the buffers are plain torch tensors, zeroed.

Contract: ``zeros(shape, dtype)`` is a contiguous CPU tensor of zeros whose data pointer is 64-byte
aligned (as torch's own CPU allocations are), and ``zeros_on(device, ...)`` that on a CPU, torch's
zeros elsewhere (every KV pool tensor: float, int8, int4); ``slots(sizes)`` cuts one buffer into 64-byte
aligned slots, and ``copy_into(slot, t)`` is a contiguous copy of ``t`` (same shape, dtype and
values) in a slot. A mapping lives as long as any tensor over it.
"""
from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor's start, as torch's CPU allocator aligns them (the kernels' vector loads)


def supported() -> bool:
    """Whether buffers come from anonymous mappings advised onto huge pages (Linux)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeros (uint8), 2 MiB aligned where ``supported``."""
    if not supported() or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    # whole huge pages only: a partly used last one would be 2 MiB resident for its few bytes
    if nbytes >= HUGE_PAGE:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start:start + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros on huge pages (see the module docstring), its pages
    written now: a first write while serving faults in a 2 MiB page (zeroed, compacted where memory
    is fragmented) inside a step, once for every layer's pool, which took the structured
    scenario's background streams' largest inter-token gap from ~50 to 208 ms."""
    nbytes = math.prod(shape) * dtype.itemsize
    return _buffer(nbytes).zero_().view(dtype).view(tuple(shape))


def zeros_on(device: torch.device, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A KV pool's tensor of zeros: ``zeros`` on a CPU where ``supported``, else ``torch.zeros``."""
    if torch.device(device).type == "cpu" and supported():
        return zeros(shape, dtype)
    return torch.zeros(tuple(shape), dtype=dtype, device=device)


def slots(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One buffer cut into uint8 slots of ``sizes`` bytes, in order, each 64-byte aligned."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    buffer = _buffer(total)
    return [buffer[o:o + n] for o, n in zip(offsets, sizes)]


def copy_into(slot: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in ``slot`` (a ``slots`` slot of exactly its bytes), as ``t``'s dtype and shape."""
    view = slot.view(t.dtype).view(t.shape)
    view.copy_(t)
    return view
