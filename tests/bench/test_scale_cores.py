"""bench.scale's fairness tools: one core per replica, and a process tree's CPU time and memory."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.machine import tree_memory_mib
from bench.scale import CorePlan, CpuUse, plan_cores, tree_cpu_seconds


def test_plan_cores():
    plan = plan_cores(2, "auto", [4, 5, 6, 7])
    assert plan == CorePlan([{4}, {5}], {6, 7})
    assert "replica0 -> core 4" in plan.describe() and "router and client -> cores 6,7" in plan.describe()
    two = plan_cores(2, "auto", [0, 1])
    assert two.replicas == [{0}, {1}] and two.others is None and "any core" in two.describe()
    assert plan_cores(2, "auto", [3]) is None  # auto: too few cores, nothing pinned
    assert plan_cores(2, "off", [0, 1, 2]) is None
    with pytest.raises(ValueError, match="needs 2 cores"):
        plan_cores(2, "on", [3])
    with pytest.raises(ValueError, match="pin must be"):
        plan_cores(2, "yes")
    if len(os.sched_getaffinity(0)) >= 2:  # the default: this process's cores, ascending
        assert plan_cores(2, "auto") is not None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_tree_cpu_seconds_counts_descendants():
    """A parent that sleeps and a grandchild that spins: the tree's CPU time is the grandchild's."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {spin!r}])\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while (used := tree_cpu_seconds(parent.pid)) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert used >= 0.6
    finally:
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == parent.pid]
        for pid in kids:
            os.kill(pid, 9)
        parent.kill()
        parent.wait(10)
    assert tree_cpu_seconds(parent.pid) == 0.0  # gone
    use = CpuUse("replica0", cpu_s=9.0, wall_s=10.0, output_tokens=120, cores="0")
    assert use.utilization == pytest.approx(0.9) and "90% of one core, 120 output tokens" in use.describe()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_tree_memory_counts_descendants():
    """A parent that sleeps and its child that writes 200 MiB: the parent's tree holds the
    child's resident memory plus the parent's own."""
    hold = "b = b'x' * (200 << 20)\nopen(0).read()"  # every page written (a zeroed bytearray may stay unmapped)
    code = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', {hold!r}], stdin=subprocess.PIPE)\n"
            "print(p.pid, flush=True)\nsys.stdin.read()\np.stdin.close()\np.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while ((own := tree_memory_mib(child)) is None or own["rss"] < 200) and time.monotonic() < deadline:
            time.sleep(0.1)
        mem = tree_memory_mib(parent.pid)
        assert own is not None and own["rss"] >= 200 and own["peak"] >= own["rss"]
        assert mem is not None and 0 < mem["rss"] - own["rss"] < 100  # the rest is the parent
    finally:
        parent.communicate("", timeout=30)
    assert tree_memory_mib(parent.pid) is None  # gone


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
