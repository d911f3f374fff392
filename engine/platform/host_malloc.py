"""glibc's malloc for the engine process: one arena, and the heap trimmed after the load.

glibc hands a thread that finds the main arena locked an arena of its own, and the thread keeps
it; memory freed in one arena is reused only by allocations made in that arena. With the OpenMP
workers running beside the engine thread, a prefill's activations (tens of MiB a layer) end up
split across two arenas that each keep their own high-water mark: on the 1B-shaped Q4_K_M
(``python -m bench.probes.gguf_decode --model F --resident blocks --activation-quant int8``) the
second arena held 63 MiB, and one arena lowered the peak RSS from 1,533 to 1,493 MiB with the
prefill and decode times unchanged (the engine's threads rarely allocate at the same time).

The limit binds only arenas not yet made, so it is set first thing in the engine. Elsewhere
than glibc (musl, macOS) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's malloc.h


def _libc_function(name: str) -> Any:
    """The C library's function ``name``, or None: not Linux, no libc by that name, or one
    without it (musl has neither mallopt's arena setting nor malloc_trim)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def limit_malloc_arenas(count: int = 1) -> bool:
    """Cap glibc's malloc arenas at ``count``; True when the C library took the setting."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = mallopt(_M_ARENA_MAX, count) == 1
    logger.debug("malloc arenas capped at %d: %s", count, taken)
    return taken


def trim_malloc() -> bool:
    """Hand the heap's free memory back to the system (glibc ``malloc_trim``): after the load
    copies the weights into huge_pages' buffer, the originals' freed chunks stay resident in the
    arena otherwise (~0.1 GB for SmolLM2). True when the C library did."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1
