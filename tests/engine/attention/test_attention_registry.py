"""Backend names live in one registry; selection per device; impossible choices explain why."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.attention import (ATTENTION_BACKENDS, BACKENDS, FlashAttention, NativeAttention, TorchAttention,
                              TritonAttention, resolve_backend, select_attention)
from engine.config import ModelConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a cuda device object needs no GPU


@pytest.fixture
def flash_attn_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real(name, *a))


@pytest.fixture
def triton_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))


def test_one_list_of_names():
    assert set(ATTENTION_BACKENDS) == set(BACKENDS) | {"auto"}
    assert {n: c.name for n, c in BACKENDS.items()} == {n: n for n in BACKENDS}
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, native, triton, flash_attn"):
        ModelConfig(attention_backend="flash")
    from kvserve.cli import add_engine_args
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    action = next(a for a in parser._actions if a.dest == "attention_backend")
    assert tuple(action.choices) == ATTENTION_BACKENDS


def test_auto_on_cpu():
    from engine.kernels import load_kernels

    expected = NativeAttention if load_kernels() else TorchAttention
    assert type(select_attention("auto", CPU, torch.float32)) is expected
    assert type(select_attention("auto", CPU, torch.bfloat16)) is TorchAttention  # native is fp32-only


def test_auto_on_cuda_prefers_flash_attn_then_triton(flash_attn_installed):
    assert resolve_backend("auto", CUDA, torch.bfloat16, 256) == "flash_attn"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 16) == "triton"  # flash-attn pages are 256 tokens
    assert resolve_backend("auto", CUDA, torch.float32, 256) == "triton"  # flash-attn is fp16/bf16 only


def test_int8_kv_on_cuda_stays_on_triton(flash_attn_installed):
    """flash-attn reads float pools only: ``auto`` with an int8 pool takes Triton, which
    dequantizes inside its kernels; naming flash_attn says why not and what does run int8."""
    assert resolve_backend("auto", CUDA, torch.bfloat16, 256) == "flash_attn"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 256, kv_cache_dtype="int8") == "triton"
    assert resolve_backend("triton", CUDA, torch.bfloat16, 16, kv_cache_dtype="int8") == "triton"
    with pytest.raises(ValueError, match="'flash_attn' cannot run on cuda in bfloat16 with block_size 256 with an "
                                         "int8 KV pool: its kernels do not read int8 KV pools; kv_cache_dtype int8 "
                                         "runs on torch, native, triton"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 256, kv_cache_dtype="int8")
    assert [n for n, c in BACKENDS.items() if "int8" in c.kv_cache_dtypes] == ["torch", "native", "triton"]


def test_int8_kv_on_cuda_without_triton(triton_missing, monkeypatch):
    monkeypatch.setattr(FlashAttention, "unavailable", classmethod(lambda cls, *a: None))
    assert resolve_backend("auto", CUDA, torch.bfloat16, 256, kv_cache_dtype="int8") == "torch"


def test_auto_on_cuda_without_flash_attn_or_triton(triton_missing):
    if importlib.util.find_spec("flash_attn") is None:
        assert resolve_backend("auto", CUDA, torch.bfloat16, 256) == "torch"


@pytest.mark.parametrize("name, device, dtype, block, reason", [
    ("native", CUDA, torch.bfloat16, 16, "CPU in float32 only"),
    ("native", CPU, torch.bfloat16, 16, "CPU in float32 only"),
    ("flash_attn", CPU, torch.bfloat16, 256, "CUDA devices only"),
    ("flash_attn", CUDA, torch.float32, 256, "bfloat16 or float16"),
])
def test_impossible_choices(name, device, dtype, block, reason):
    with pytest.raises(ValueError, match=f"attention_backend '{name}' cannot run on {device.type}.*{reason}"):
        resolve_backend(name, device, dtype, block)


def test_flash_attn_page_rule(flash_attn_installed):
    assert resolve_backend("flash_attn", CUDA, torch.bfloat16, 512) == "flash_attn"
    with pytest.raises(ValueError, match="multiple of 256 .got 16.; set --block-size 256 or use the triton"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 16)


def test_flash_attn_not_installed():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ValueError, match="flash-attn package is not installed"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 256)


def test_triton_needs_the_package(triton_missing):
    with pytest.raises(ValueError, match="triton package is not installed"):
        resolve_backend("triton", CUDA, torch.bfloat16, 16)


def test_triton_on_cpu_only_in_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="run on CUDA devices .on cpu only under TRITON_INTERPRET=1"):
        resolve_backend("triton", CPU, torch.float32, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if importlib.util.find_spec("triton") is not None:
        assert resolve_backend("triton", CPU, torch.float32, 16) == "triton"


def test_flags():
    assert TritonAttention.graph_safe_decode and FlashAttention.graph_safe_decode
    assert not TorchAttention.graph_safe_decode and not NativeAttention.graph_safe_decode
    assert TritonAttention.uses_paged_layout and not TorchAttention.uses_paged_layout


def test_engine_refuses_flash_attn_on_cpu():
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    with pytest.raises(ValueError, match="'flash_attn' cannot run on cpu"):
        tiny_engine(tiny_hf_model(tiny_llama_config(num_hidden_layers=1)), attention_backend="flash_attn")


def test_validating_a_config_imports_neither_torch_nor_a_backend():
    """The frontend and the CLI validate ``ModelConfig`` without the model's stack."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\n"
            "from engine.config import EngineConfig, ModelConfig\n"
            "EngineConfig(model=ModelConfig(attention_backend='native'))\n"
            "try:\n"
            "    ModelConfig(attention_backend='flash')\n"
            "except ValueError:\n"
            "    pass\n"
            "print(sorted(m for m in ('torch', 'engine.attention') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
