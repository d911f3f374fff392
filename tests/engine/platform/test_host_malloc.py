"""engine/platform/host_malloc.py against the real glibc, in a child process (its malloc
settings would otherwise stay with the test process): the arena cap is taken, and trim_malloc
hands freed heap chunks back, which glibc otherwise keeps resident."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import ctypes, os
from engine.platform.host_malloc import limit_malloc_arenas, trim_malloc

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

assert limit_malloc_arenas(1)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: 64 KiB chunks come from the heap, not mmap
chunks = [libc.malloc(65536) for _ in range(3000)]  # ~200 MB
for c in chunks:
    ctypes.memset(c, 1, 65536)
top = libc.malloc(64)  # above them all: free() alone cannot shrink the heap
ctypes.memset(top, 1, 64)
for c in chunks:
    libc.free(c)
freed = rss()
assert trim_malloc()
print(freed, rss())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_arena_cap_is_taken_and_the_trim_returns_freed_chunks():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    freed, trimmed = map(int, out.stdout.split())
    assert freed - trimmed > 150 << 20, (freed, trimmed)  # the ~200 MB freed were still resident until the trim
