"""A prefill chunk's row ops (engine/kernels/cpu/prefill_rows.cpp) against float64 arithmetic on
the same inputs, and the layer that binds them against torch's composites.

Contract: ``rms_norm`` is F.rms_norm in fp32 (the sum in another order), ``add_rms_norm_`` writes
h + x over h bit for bit as torch's add and norms that, ``rope_`` rotates the first ``heads``
heads of each row in place and touches nothing else. Errors are fp32 rounding: a wrong row, head,
half or stride would be off by the size of the values themselves."""
from __future__ import annotations

import pytest
import torch

from engine.model.rope import apply_rope_signed
from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x, w = x.double(), w.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("rows,hidden", [(1, 64), (13, 576), (130, 2048)])
def test_rms_norm_and_the_fused_residual_add_are_fp32_rounding_of_float64(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, h = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g) * 3
    w, eps = torch.rand(hidden, generator=g) + 0.5, 1e-5
    got = torch.ops.kvserve.rms_norm(x, w, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), rms_norm64(x, w, eps), rtol=1e-6, atol=1e-6)
    want_sum = x + h
    hh = h.clone()
    normed = torch.ops.kvserve.add_rms_norm_(hh, x, w, eps)
    assert torch.equal(hh, want_sum)  # the residual stream: torch's fp32 add, bit for bit
    torch.testing.assert_close(normed.double(), rms_norm64(want_sum, w, eps), rtol=1e-6, atol=1e-6)
    # and within rounding of torch's own composite
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(want_sum, (hidden,), w, eps))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (2, 1, 16)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(heads, kv_heads, dim):
    g = torch.Generator().manual_seed(dim)
    rows, rotated = 37, heads + kv_heads
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    angle = torch.rand(rows, dim // 2, generator=g, dtype=torch.float64) * 100
    cos64 = torch.cat([angle.cos(), angle.cos()], -1)
    sin64 = torch.cat([-angle.sin(), angle.sin()], -1)  # signed: the first half negated
    cos, sin = cos64.float(), sin64.float()
    out = qkv.clone()
    torch.ops.kvserve.rope_(out, cos, sin, rotated)
    x = qkv[:, :rotated * dim].view(rows, rotated, dim).double()
    half = dim // 2
    want = x * cos.double()[:, None] + torch.cat([x[..., half:], x[..., :half]], -1) * sin.double()[:, None]
    torch.testing.assert_close(out[:, :rotated * dim].view(rows, rotated, dim).double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, rotated * dim:], qkv[:, rotated * dim:])
    # the same rotation as the torch path's apply_rope_signed, within fp32 rounding
    ref = apply_rope_signed(qkv[:, :rotated * dim].view(rows, rotated, dim), cos[:, None], sin[:, None])
    torch.testing.assert_close(out[:, :rotated * dim].view(rows, rotated, dim), ref)


def test_rope_takes_a_row_strided_view():
    """A slice of wider rows: the op follows the row stride and writes nothing past the heads."""
    base = torch.randn(5, 3 * 32)
    cos, sin = torch.randn(5, 32), torch.randn(5, 32)
    view = base[:, :64]
    expected = apply_rope_signed(view.reshape(5, 2, 32).clone(), cos[:, None], sin[:, None]).reshape(5, 64)
    tail = base[:, 64:].clone()
    torch.ops.kvserve.rope_(view, cos, sin, 2)
    torch.testing.assert_close(base[:, :64], expected)
    assert torch.equal(base[:, 64:], tail)


def test_errors_name_the_argument():
    ops = torch.ops.kvserve
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-d float32 CPU tensor"):
        ops.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32 vector of 8"):
        ops.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="h and x must have one shape"):
        ops.add_rms_norm_(x.clone(), torch.randn(3, 8), w, 1e-5)
    with pytest.raises(RuntimeError, match="3 heads of 4 do not fit 8 columns"):
        ops.rope_(x.clone(), torch.ones(4, 4), torch.ones(4, 4), 3)
    with pytest.raises(RuntimeError, match="cos and sin must both be"):
        ops.rope_(x.clone(), torch.ones(4, 4), torch.ones(3, 4), 1)
