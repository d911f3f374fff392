"""``engine.prefill_dtype``: the one rule behind ``prefill_attention_dtype`` and
``prefill_matmul_dtype``, through each field's own resolver, with the CPU's bf16 kernels faked
both ways (each field's kernels: tests/engine/attention/test_prefill_precision.py and
tests/engine/model/test_prefill_matmul_dtype.py)."""
from __future__ import annotations

import pytest
import torch

from engine.attention import precision
from engine.config import ModelConfig
from engine.model import linear

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32 = torch.float32
# field -> (its resolver, the module whose CPU check it asks, that check's name)
FIELDS = {
    "prefill_attention_dtype": (precision.resolve_prefill_attention_dtype, precision, "has_amx_bf16"),
    "prefill_matmul_dtype": (linear.resolve_prefill_matmul_dtype, linear, "bf16_matmul_runs"),
}


def fake_tiles(monkeypatch, field: str, runs: bool):
    resolve, module, check = FIELDS[field]
    monkeypatch.setattr(module, check, lambda: runs)
    return resolve


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("tiles", [True, False])
def test_auto_is_bfloat16_only_with_int8_activations_where_the_tiles_run(monkeypatch, field, tiles):
    resolve = fake_tiles(monkeypatch, field, tiles)
    assert resolve("auto", CPU, F32, "int8") == ("bfloat16" if tiles else "float32")
    # the exact flags compute exactly; so do tensor parallel ranks, a GPU and a model of another dtype
    assert resolve("auto", CPU, F32, "none") == "float32"
    assert resolve("auto", CPU, F32, "int8", tensor_parallel_size=2) == "float32"
    assert resolve("auto", CUDA, F32, "int8") == "float32"
    assert resolve("auto", CPU, torch.bfloat16, "int8") == "float32"
    # explicit choices stand where they can run
    assert resolve("float32", CPU, F32, "int8") == "float32"
    assert resolve("float32", CUDA, torch.float16, "none") == "float32"


@pytest.mark.parametrize("field", FIELDS)
def test_explicit_bfloat16_is_refused_where_it_has_no_meaning(monkeypatch, field):
    resolve = fake_tiles(monkeypatch, field, True)
    assert resolve("bfloat16", CPU, F32, "none") == "bfloat16"
    for device, dtype in ((CUDA, F32), (CPU, torch.float16)):
        with pytest.raises(ValueError, match=f"^{field} 'bfloat16' applies to a float32 model on the CPU"):
            resolve("bfloat16", device, dtype, "int8")
    with pytest.raises(ValueError, match=f"^{field} 'bfloat16' is not implemented with tensor_parallel_size > 1"):
        resolve("bfloat16", CPU, F32, "int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=f"{field} must be auto, float32 or bfloat16"):
        ModelConfig(**{field: "float16"})


def test_without_amx_explicit_bfloat16_attention_falls_back_but_the_matmuls_refuse(monkeypatch):
    """The attention has torch's flash kernel in bf16 to fall back to; the block matmuls have none."""
    assert fake_tiles(monkeypatch, "prefill_attention_dtype", False)("bfloat16", CPU, F32, "int8") == "bfloat16"
    resolve = fake_tiles(monkeypatch, "prefill_matmul_dtype", False)
    with pytest.raises(ValueError, match="^prefill_matmul_dtype 'bfloat16' needs the native kernels on a CPU "
                                         "with AMX-BF16"):
        resolve("bfloat16", CPU, F32, "int8")
