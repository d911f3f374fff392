"""Building the native kernel: it degrades to the torch backend instead of failing the engine, and its
build-time ISA paths compile on hosts that do not build them."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import kernels
from engine.attention import TorchAttention, select_attention


def test_broken_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_registered", lambda: False)  # as in a process that never loaded it
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels._load() is False
    assert "Native kernels unavailable (compiler failed); using the torch backend" in caplog.text
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no half-written library or object left behind


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_DISABLE_KERNELS", "1")
    assert kernels._load() is False


def test_backend_choice():
    assert type(select_attention("torch", torch.device("cpu"), torch.float32)) is TorchAttention
    assert type(select_attention("auto", torch.device("cpu"), torch.bfloat16)) is TorchAttention
    with pytest.raises(ValueError, match="CPU in float32"):
        select_attention("native", torch.device("cpu"), torch.bfloat16)


def _defines(compiler: str, march: str) -> str:
    import subprocess

    done = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else ""


def test_the_build_time_avx512_paths_compile_on_any_host():
    """quant_linear_q8.cpp is the one kernel source with paths chosen at build time: its K-quant
    kernels take vpdpbusd and 512-bit registers (KVSERVE_VNNI_BUILD, KVSERVE_ZMM_ROWS) only where
    the build targets AVX512-VNNI and BW, as -march=native does on Ice Lake, Sapphire Rapids or Zen 4.
    A host without them never compiles those lines, so a change there could break every such build
    unseen (one did: a prefetch meant for the ymm lanes also landed in the zmm lane_rows). Here the
    source is compiled for -march=sapphirerapids with the build's own flags, syntax only (~15 s)."""
    import subprocess

    compiler = kernels._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler: the kernels are not built here")
    native = _defines(compiler, "native")
    if "__AVX512VNNI__" in native and "__AVX512BW__" in native:
        pytest.skip("this host's own build compiles the AVX512-VNNI paths (every kernel test runs them)")
    spr = _defines(compiler, "sapphirerapids")
    if "__AVX512VNNI__" not in spr:
        pytest.skip(f"{compiler} does not know -march=sapphirerapids")
    flags = [f for f in kernels._build_flags()[0] if not f.startswith("-march") and not f.startswith("-mtune")]
    source = kernels.CPU_DIR / "quant_linear_q8.cpp"
    done = subprocess.run([compiler, *flags, "-march=sapphirerapids", "-w", "-fsyntax-only", str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
