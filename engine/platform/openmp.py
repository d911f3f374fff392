"""Releasing a thread's OpenMP workers, so the engine loop thread gets the cores to itself.

torch (and kvserve's kernels) run intra-op parallel regions on libgomp, which keeps one pool
of worker threads per thread that starts regions. Loading the model runs regions on the main
thread, so by the time the engine loop thread starts stepping, libgomp manages two pools,
more threads than this machine's two cores. libgomp then throttles its spin-waiting: workers
go to sleep between regions, and every one of the ~300 small regions of a decode step pays a
wake-up. Measured here: single-stream decode 15 ms/token on the main thread, 28 ms/token on
the loop thread, 15 ms again once the main thread's pool is released (OpenMP 5.0's
``omp_pause_resource_all``; a later region on the main thread would simply start a new pool).
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep settings


def loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's own copy on PyPI builds)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "libgomp" in path and path.startswith("/"):
                    return path
    except OSError:
        pass
    return None


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker pool; True when libgomp did. A no-op (False)
    without libgomp (another OpenMP runtime, or none) or before OpenMP 5.0."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    done = pause(OMP_PAUSE_SOFT) == 0
    if not done:
        logger.debug("omp_pause_resource_all refused to release this thread's OpenMP pool")
    return done
