"""Sizing the KV pool on a GPU from what a profiling forward pass leaves free.

The arithmetic (``kv_budget_bytes``) is plain integers and tested on any machine; the
measurement (``profile_kv_budget``) needs a CUDA device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# Kept back for CUDA graphs, the sampler's temporaries and allocator fragmentation.
GRAPH_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class GpuMemoryProfile:
    total: int  # the device's memory
    used: int  # in use after the profiling pass (weights, this process's caches, other processes)
    activation_peak: int  # the profiling pass's transient peak above what stays allocated
    utilization: float
    reserve: int

    @property
    def kv_budget(self) -> int:
        return kv_budget_bytes(self.total, self.used, self.activation_peak, self.utilization, self.reserve)

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"GPU memory: {self.total / gib:.1f} GiB total, {self.utilization:.2f} usable; in use after "
                f"profiling {self.used / gib:.2f} GiB (weights and other processes), activation peak "
                f"{self.activation_peak / gib:.2f} GiB, reserve {self.reserve / gib:.2f} GiB "
                f"-> KV pool {self.kv_budget / gib:.2f} GiB")


def kv_budget_bytes(total: int, used: int, activation_peak: int, utilization: float, reserve: int) -> int:
    """Bytes left to the KV pool: ``utilization * total`` minus what is in use, the
    activation peak a step may need on top of it, and a reserve; never negative."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return max(0, int(total * utilization) - used - activation_peak - reserve)


def profile_kv_budget(device: torch.device, utilization: float, run_profile: Callable[[], None],
                      reserve: int = GRAPH_RESERVE_BYTES) -> GpuMemoryProfile:
    """Run ``run_profile`` (a forward pass at the largest step the scheduler may plan) and
    measure; CUDA only. Memory other processes hold counts as used."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemoryProfile(total=total, used=total - free, activation_peak=activation_peak,
                            utilization=utilization, reserve=min(reserve, total // 20))
