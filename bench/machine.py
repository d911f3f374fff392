"""The machine a number was measured on: threads, CPU facts, and the load other processes put on it.

Absolute throughput on a shared 2-core machine moves by 2x from one minute to the next, ratios
measured back to back move much less, so the suite records the load beside every result:
``CpuMonitor`` / ``LoadMonitor`` measure the cores other processes used while a block ran
(``LoadMonitor`` counts a server subprocess tree as ours), ``wait_for_quiet`` waits for them to
stop, ``machine_info`` is stored with every result.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch


def set_threads(num_threads: int | None) -> int:
    """Use ``num_threads`` intra-op threads (default: the cores this process may use)."""
    from engine.builder import available_cores

    n = num_threads or available_cores()
    torch.set_num_threads(n)
    return n


def machine_info() -> dict[str, Any]:
    """Facts that explain a number: torch version and threads, cores, load average."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "threads": torch.get_num_threads(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg_1m": round(load[0], 2),
        "loadavg_5m": round(load[1], 2),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


class CpuMonitor:
    """How much CPU *other* processes used while a block ran (from /proc/stat and this
    process's own CPU time). ``foreign_cores`` near 0 means the measurement had the machine
    to itself; 0.5 or more on a 2-core machine makes 2-thread matmuls unreliable."""

    def __enter__(self) -> "CpuMonitor":
        self._busy0, self._own0, self._t0 = _system_busy_s(), _own_cpu_s(), time.perf_counter()
        self.foreign_cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = _system_busy_s(), _own_cpu_s(), time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.foreign_cores = round(max(0.0, (busy - self._busy0) - (own - self._own0)) / wall, 2)


class LoadMonitor:
    """CPU used by *other* processes while a block ran, in cores: the whole machine's busy time
    minus this process, its finished children (node) and ``pids`` (the server subprocess with its
    live descendants: the engine core process and any tensor-parallel ranks).
    ``CpuMonitor`` (above) counts a server subprocess as foreign; this one does not."""

    def __init__(self, pids: Sequence[int | None] = ()) -> None:
        self.pids = [p for p in pids if p]
        self.foreign_cores: float | None = None

    def _ours(self) -> float:
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        # With the engine core in its own process (and its tensor-parallel ranks) the server is a tree.
        return total + sum(tree_cpu_seconds(pid) for pid in self.pids)

    def __enter__(self) -> "LoadMonitor":
        self._busy0, self._ours0, self._t0 = _system_busy_s(), self._ours(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, ours, wall = _system_busy_s(), self._ours(), time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.foreign_cores = round(max(0.0, (busy - self._busy0) - (ours - self._ours0)) / wall, 2)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 1.0) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold_cores`` cores
    over a ``window_s`` window; returns the last foreign load seen (None if unknown)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with CpuMonitor() as mon:
            time.sleep(window_s)
        if mon.foreign_cores is None or mon.foreign_cores < threshold_cores or time.monotonic() >= deadline:
            return mon.foreign_cores


def _system_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process (Linux /proc), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _tree(pid: int) -> dict[int, float]:
    """``pid`` and its live descendants, each with its CPU seconds so far (Linux /proc)."""
    if not Path("/proc").is_dir():
        return {}
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in stats and p not in found:
            found[p] = stats[p][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (a server's frontend, engine
    core and tensor-parallel ranks). Linux only; 0.0 elsewhere."""
    return sum(_tree(pid).values())


def tree_memory_mib(pid: int) -> dict[str, float] | None:
    """Resident memory of ``pid`` and its live descendants, MiB: ``rss`` now and ``peak`` (the sum
    of each process's high-water mark, VmHWM: at least the tree's own peak). None where /proc
    has neither (not Linux, or the process is gone)."""
    rss = peak = 0
    for p in _tree(pid):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        rss += int(fields.get("VmRSS", "0 kB").split()[0])
        peak += int(fields.get("VmHWM", "0 kB").split()[0])
    return {"rss": round(rss / 1024, 1), "peak": round(peak / 1024, 1)} if rss else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - informational only
        return None


def memory_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of a ``sum`` over a tensor far larger than the caches, best of
    ``repeats``, with the current torch thread count."""
    x = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    nbytes = x.numel() * 4
    del x
    return nbytes / best / 1e9


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
