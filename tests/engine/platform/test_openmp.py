"""The engine loop thread gets the cores to itself: the building thread's OpenMP pool is released."""
from __future__ import annotations

import threading

import torch

from engine.platform.openmp import loaded_libgomp, release_openmp_threads


def test_releases_this_threads_pool_and_openmp_still_works():
    x = torch.randn(200_000)
    torch.exp(x)  # a parallel region on this thread: libgomp now holds a pool for it
    assert loaded_libgomp() is not None  # torch's CPU wheels use libgomp
    assert release_openmp_threads() is True
    torch.testing.assert_close(torch.exp(x), x.exp())  # a new region simply starts a new pool
    results = []
    worker = threading.Thread(target=lambda: results.append(float(torch.exp(x).sum())))
    worker.start()
    worker.join()
    assert results and results[0] > 0
