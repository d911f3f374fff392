"""The AMX-BF16 prefill attention kernel (``prefill_attention``, engine/kernels/cpu/prefill_attention.cpp)
against a float64 reference of its inputs rounded to bf16: every query-row tile and 64-key step
boundary, grouped heads, a cached prefix, fp32 / fp16 / bf16 and strided inputs; causality
exactly (later keys change nothing before them); its refusals. Runs where the CPU has AMX-BF16
(as this project's CI machine does); skipped elsewhere, where the engine keeps SDPA."""
from __future__ import annotations

import pytest
import torch

from engine.attention.native import native_prefill_runs
from tests.engine.attention.test_prefill_precision import bf16, reference  # float64 causal attention
from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()
    if not native_prefill_runs(64):
        pytest.skip("no AMX-BF16 on this CPU: prefill chunks attend through SDPA")


def rounded_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    """The float64 causal reference of q, keys and values rounded to bf16."""
    return reference(bf16(q), bf16(keys.float()), bf16(values.float()), prefix)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    return torch.ops.kvserve.prefill_attention(q, keys, values, prefix, q.shape[-1] ** -0.5)


def inputs(n: int, prefix: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=gen) * 2
    keys = (torch.randn(prefix + n, kv_heads, d, generator=gen) * 2).to(dtype)
    values = torch.randn(prefix + n, kv_heads, d, generator=gen).to(dtype)
    return q, keys, values


@pytest.mark.parametrize("n, prefix", [(1, 0), (15, 0), (16, 0), (17, 3), (63, 1), (64, 64), (65, 130), (200, 37)])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_agrees_with_a_float64_reference_of_bf16_inputs(n, prefix, heads, kv_heads, d):
    q, keys, values = inputs(n, prefix, heads, kv_heads, d, torch.float32, n * 1000 + prefix)
    got = attend(q, keys, values, prefix)
    assert got.dtype == torch.float32 and got.shape == (n, heads, d)
    err = (got.double() - rounded_reference(q, keys, values, prefix)).abs()
    # bf16's rounding of the probabilities (2^-9 relative) is the only rounding left beyond fp32:
    # measured max 0.0016-0.0034 where torch's bf16 SDPA (output rounded to bf16 too) is 0.004-0.008
    assert err.max().item() < 6e-3, err.max()
    assert err.mean().item() < 1e-3, err.mean()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_read_as_they_are(dtype):
    """fp16 pools (the CPU default) and bf16 tensors: the same numbers as their fp32 values."""
    q, keys, values = inputs(40, 70, 9, 3, 64, dtype, 7)
    got = attend(q.to(dtype), keys, values, 70)
    assert torch.equal(got, attend(q.to(dtype).float(), keys.float(), values.float(), 70))


def test_strided_keys_and_values():
    """The engine passes a gathered copy's ``[L, kv_heads, d]`` transposed view: any strides but the last."""
    q, keys, values = inputs(33, 20, 9, 3, 64, torch.float16, 3)
    wide_k = torch.zeros(keys.shape[1], keys.shape[0], 64, dtype=keys.dtype)
    wide_v = torch.zeros_like(wide_k)
    wide_k.copy_(keys.transpose(0, 1)), wide_v.copy_(values.transpose(0, 1))
    strided_k, strided_v = wide_k.transpose(0, 1), wide_v.transpose(0, 1)
    assert not strided_k.is_contiguous()
    assert torch.equal(attend(q, strided_k, strided_v, 20), attend(q, keys, values, 20))


def test_causal_exactly():
    """Changing the keys and values after position p changes no row at or before p, bit for bit."""
    n, prefix = 100, 30
    q, keys, values = inputs(n, prefix, 9, 3, 64, torch.float32, 11)
    before = attend(q, keys, values, prefix)
    cut = prefix + 41  # rows 0..41 see keys 0..cut
    keys[cut + 1:] += 5.0
    values[cut + 1:] *= -3.0
    after = attend(q, keys, values, prefix)
    assert torch.equal(after[:42], before[:42])
    assert not torch.equal(after[42:], before[42:])


def test_refusals():
    q, keys, values = inputs(8, 0, 9, 3, 64, torch.float32, 0)
    with pytest.raises(RuntimeError, match="prefix \\+ n rows"):
        attend(q, keys[:7], values[:7], 0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        attend(q[:, :8], keys, values, 0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        attend(q[..., :48].contiguous(), keys[..., :48].contiguous(), values[..., :48].contiguous(), 0)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        attend(q.double(), keys, values, 0)
