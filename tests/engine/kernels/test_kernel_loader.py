"""Building the native kernel degrades to the torch backend instead of failing the engine."""
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
