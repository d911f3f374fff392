"""What the host CPU can do, as the kernel reports it in ``/proc/cpuinfo``'s ``flags`` line.

For choices made once at start that depend on an instruction set torch does not expose a query
for (torch 2.13 dropped ``torch._C._cpu._is_amx_tile_supported``). The project's one reader of
these flags (bench/roofline.py reports them too). Not Linux, or no such file:
no flags, so every choice falls back to its portable side.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first CPU a ``/proc/cpuinfo`` text lists (every core of a host has
    the same ones); none where there is no such line (an ARM kernel says ``Features``)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This host's CPU flags (read once)."""
    try:
        return flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def has_amx_bf16() -> bool:
    """AMX tiles with bf16 products (Sapphire Rapids and later Xeons): oneDNN, and with it
    torch's CPU attention and matmuls on bf16 tensors, runs on them."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()
