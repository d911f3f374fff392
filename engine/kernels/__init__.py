"""Native CPU kernels, compiled on first use with the machine's C++ compiler.

Nine kernels, one library:

* ``paged_attention.cpp``: paged decode attention. It reads each sequence's keys and values
  in place from the block pool instead of gathering them into a contiguous copy first,
  which triples the memory traffic of batched decode in the torch backend; optionally adds
  each row's softmax mass per block (H2O eviction) from the same pass.
* ``quant_linear.cpp``: linear layers computed straight from GGUF blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, and F16/BF16 halves), for the
  few-row matmuls of decode, which stream every weight once per step (see engine/loader/gguf/blocks.py).
* ``quant_linear_q8.cpp``: the same matmuls on int8-quantized activations (Q4_1, Q8_0, Q4_K,
  Q6_K; AVX2 integer dot products, AVX512-VNNI ``vpdpbusd`` for Q4_1 / Q8_0 where the CPU has
  it), only with ``activation_quant: int8``; its AMX tile kernels, from 32 rows where the CPU
  has AMX, are ``quant_linear_amx.cpp``.
* ``decode_layer.cpp``: every decoder layer of an all-decode step in one call (``DecodeStack``)
  and one OpenMP region (the ``native`` decode path, see ``LlamaForCausalLM.select_decode_path``), on the two
  kernels above through ``paged_attention.h`` and ``quant_linear.h``.
* ``prefill_attention.cpp``: a bf16 prefill chunk's attention over its whole context on AMX-BF16
  tiles, one call a chunk (``NativeAttention._prefill``), where the CPU has AMX-BF16 and AVX512-BF16.
* ``prefill_attention_f32.cpp``: the same for an fp32 chunk in AVX2 + FMA vectors (every x86 CPU
  the int8 kernels run on), where torch's fp32 flash kernel ran before.
* ``prefill_linear.cpp``: a prefill chunk's block matmuls (and the fused SiLU(gate) * up) on
  AMX-BF16 tiles, x and each panel of decoded weights rounded to bf16, fp32 sums
  (``BlockLinear`` with ``prefill_matmul_dtype`` bfloat16: Q4_K / Q6_K from 32 rows, Q4_1 / Q5_0 /
  Q8_0 from 128 (those five decoded straight to bf16), Q5_K from 128).
* ``prefill_rows.cpp``: a prefill chunk's row ops in one pass each (``rms_norm``, the residual
  add fused with the norm after it, ``add_rms_norm_``, and RoPE in place, ``rope_``), where torch's
  CPU composites take four to six (``DecoderLayer.native_rows``), with the decode layer's numerics.
* ``argmax.cpp``: greedy sampling's per-row arg-max over fp32 logits (torch's ids: the first
  maximum, the first NaN), in 512-bit lanes where the CPU has them, else 256-bit (engine/sampling/sampler.py).

The headers they share, each source including the ones it uses (``cpu/`` is package data, not
a package: no ``__init__.py``; pyproject ships its ``*.cpp`` and ``*.h``, and every header is
part of the build's cache key):

* ``amx_tiles.h``: what the AMX tile kernels share (``KVSERVE_AMX``, the tile configuration).
* ``cpu_features.h``: what the CPU runs (``cpu_has_avx2``, ``cpu_has_avx512f``, ``detect_vnni``,
  ``cpu_has_amx``) and the ``KVSERVE_X86`` build test; the vector paths are compiled for their
  own targets whatever the flags and chosen at run time by these.
* ``vec_math.h``: small vector math more than one kernel computes (``exp_nonpositive``,
  ``silu_mul``, ``rms_norm_row``, ``rope_row``, ``hsum8``), so all compute the same numbers.
* ``block_codes.h``: the GGUF block formats' codes and sizes, and the unpacking of their codes.
* ``paged_attention.h``: the per-sequence attention routine (``attend``).
* ``prefill_attention.h``: the two prefill attention kernels' contract and its argument checks.
* ``kv_int4.h``: int4 (KIVI) pools: their block quantization and attention routine
  (``attend_int4``), for ``paged_attention_int4.cpp`` and ``decode_layer.cpp``.
* ``quant_linear.h``: the block matmuls as plain functions (``gguf_linear_range``,
  ``gguf_linear_q8_range`` with its ``Q8Act`` activations) and their weight prefetch.

The library is built once per (sources, flags, torch version) into
``$KVSERVE_CACHE_DIR/kernels`` (default ``~/.cache/kvserve/kernels``) with plain ``g++`` for
this CPU (``-march=native``; the cache key includes the CPU model and flags): each source to an
object, as many at once as the process has CPUs, then one link, with no ninja and no pybind (the
.so registers ``torch.ops.kvserve.*`` when loaded), written to a temporary name and renamed, so
concurrent processes never load a half-written library.

``load_kernels()`` never raises: without a compiler, or on any build error, it logs one
warning and returns False, and callers use the torch paths.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
# bandit B404: the C++ kernels are compiled at first use (_build)
import subprocess  # nosec B404
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.paths import conversion_cache_dir

logger = logging.getLogger(__name__)

CPU_DIR = Path(__file__).parent / "cpu"
SOURCES = sorted(CPU_DIR.glob("*.cpp"))
HEADERS = sorted(CPU_DIR.glob("*.h"))  # included by the sources: part of the cache key
_lock = threading.Lock()
_loaded: bool | None = None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags): the first for each source's object, both for the library."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fno-trapping-math: the kernels never read the FP exception flags, and without it GCC will not
    # if-convert a select such as exp_nonpositive's clamp on AVX2 targets, so every loop over it
    # (silu_mul, the softmaxes) stayed scalar there: 16% of a 512-row fused gate/up matmul on a
    # Zen 3. Values are unchanged: it only lets the compiler run FP operations speculatively.
    compile_flags = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-trapping-math",
                     f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    # The build is for this machine's CPU (vector width matters: ~2x with AVX-512 over SSE2 for
    # the attention kernel). An image built on one machine and run on others sets e.g.
    # KVSERVE_KERNEL_CFLAGS=-mtune=generic; the block matmul's AVX2 path is compiled either way
    # and chosen at run time by what the CPU supports.
    compile_flags += os.environ.get("KVSERVE_KERNEL_CFLAGS", "-march=native").split()
    compile_flags += [f"-I{p}" for p in include_paths()]
    link_flags = ["-shared", "-fopenmp"]
    for p in library_paths():
        link_flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return compile_flags, link_flags + ["-lc10", "-ltorch_cpu"]


def kernel_dir() -> Path:
    return conversion_cache_dir() / "kernels"


def _cpu_identity() -> bytes:
    """What -march=native compiles for: a cached build is reused only on the same CPU model."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines))).encode()


def _library_path(flags: tuple[list[str], list[str]]) -> Path:
    compile_flags, link_flags = flags
    cpu = _cpu_identity() if "-march=native" in compile_flags else b""
    sources = b"".join(s.name.encode() + b"\0" + s.read_bytes() for s in SOURCES + HEADERS)
    key = hashlib.sha256(sources + "\0".join(compile_flags + link_flags).encode() + torch.__version__.encode()
                         + sys.version.encode() + cpu).hexdigest()[:16]
    return kernel_dir() / f"kvserve_kernels-{key}.so"


def _run_compiler(compiler: str, args: list[str]) -> None:
    # bandit B603: no shell; the compiler ($CXX or g++ on PATH, the operator's), our sources and flags
    result = subprocess.run([compiler, *args], capture_output=True, text=True)  # nosec B603
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "compiler failed")


def _build(compiler: str, flags: tuple[list[str], list[str]], target: Path) -> None:
    """Compile each source to an object, as many at once as this process has CPUs (each parses
    torch's headers, most of a build's time), then link them into ``target``."""
    compile_flags, link_flags = flags
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        # the largest sources first, so the last one to start is a small one
        order = sorted(zip(SOURCES, objects), key=lambda so: -so[0].stat().st_size)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for done in [pool.submit(_run_compiler, compiler, ["-c", str(src), "-o", str(obj), *compile_flags])
                         for src, obj in order]:
                done.result()
        library = Path(tmp) / target.name
        _run_compiler(compiler, [*map(str, objects), "-o", str(library), *link_flags])
        # bandit B103: a compiler's own .so mode: writable by its owner only
        os.chmod(library, 0o755)  # nosec B103
        os.replace(library, target)


def load_kernels() -> bool:
    """Make the ``torch.ops.kvserve.*`` kernels available; True when they are."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


@functools.lru_cache(maxsize=None)
def has_op(name: str) -> bool:
    """Whether ``torch.ops.kvserve.<name>`` runs here: the library loaded (built first if need
    be) and the op registered. Decided once per name, as ``load_kernels`` is once per process."""
    return load_kernels() and hasattr(torch.ops.kvserve, name)


def _registered() -> bool:
    return "kvserve::paged_decode_attention" in torch._C._dispatch_get_all_op_names()


def _load() -> bool:
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return False
    if _registered():  # a second library would collide with the first one's registration
        return True
    try:
        flags = _build_flags()
        target = _library_path(flags)
        if not target.exists():
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler (g++) on PATH")
            logger.info("Compiling the native kernels into %s (once per machine)", target.parent)
            _build(compiler, flags, target)
        torch.ops.load_library(str(target))
        return True
    except Exception as exc:  # any failure means: use the torch backend
        logger.warning("Native kernels unavailable (%s); using the torch backend", exc)
        return False
