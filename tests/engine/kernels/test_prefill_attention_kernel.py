"""kvserve's prefill attention kernels (engine/kernels/cpu/prefill_attention.h's contract): the AMX-BF16
one (``prefill_attention``, prefill_attention.cpp) against a float64 reference of its inputs rounded
to bf16, the AVX2 fp32 one (``prefill_attention_f32``, prefill_attention_f32.cpp) against a float64
reference of its inputs as they are; every tile, item, key block and step boundary, grouped heads, a
cached prefix; and for both: fp32 / fp16 / bf16 and strided inputs, causality exactly (later keys
change nothing before them), their refusals; and that the ``native`` backend sends fp32 chunks to
the fp32 kernel. Each runs where the CPU has what it needs (AMX-BF16 and AVX512-BF16, as this
project's CI machine has; AVX2, FMA and F16C); elsewhere the engine keeps SDPA and they skip."""
from __future__ import annotations

import pytest
import torch

from engine.attention.native import PREFILL_KERNELS, native_prefill_runs
from engine.attention.torch_sdpa import attend_after_prefix
from tests.engine.attention.test_prefill_precision import bf16, reference  # float64 causal attention
from tests.helpers import require_native_kernel

BF16, F32 = torch.bfloat16, torch.float32


def kernel_for(dtype: torch.dtype):
    """``attend(q, keys, values, prefix)`` on the kernel for chunks attending in ``dtype``, or a skip."""
    require_native_kernel()
    kernel = PREFILL_KERNELS[dtype]
    if not native_prefill_runs(64, dtype):
        pytest.skip(f"{kernel.name} needs {kernel.needs}: on this CPU such chunks attend through SDPA")
    op = getattr(torch.ops.kvserve, kernel.op)
    return lambda q, keys, values, prefix: op(q, keys, values, prefix, q.shape[-1] ** -0.5)


@pytest.fixture(params=[BF16, F32], ids=["amx_bf16", "avx2_f32"])
def attend(request):
    return kernel_for(request.param)


def inputs(n: int, prefix: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=gen) * 2
    keys = (torch.randn(prefix + n, kv_heads, d, generator=gen) * 2).to(dtype)
    values = torch.randn(prefix + n, kv_heads, d, generator=gen).to(dtype)
    return q, keys, values


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    """The fp32 path the AVX2 kernel replaces (TorchAttention._prefill on the CPU)."""
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.float().transpose(0, 1).unsqueeze(0)
    return attend_after_prefix(heads_first(q), heads_first(keys), heads_first(values), prefix)[0].transpose(0, 1)


SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 128)]


@pytest.mark.parametrize("n, prefix", [(1, 0), (15, 0), (16, 0), (17, 3), (63, 1), (64, 64), (65, 130), (200, 37)])
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
def test_bf16_kernel_agrees_with_a_float64_reference_of_bf16_inputs(n, prefix, heads, kv_heads, d):
    attend = kernel_for(BF16)
    q, keys, values = inputs(n, prefix, heads, kv_heads, d, torch.float32, n * 1000 + prefix)
    got = attend(q, keys, values, prefix)
    assert got.dtype == torch.float32 and got.shape == (n, heads, d)
    err = (got.double() - reference(bf16(q), bf16(keys), bf16(values), prefix)).abs()
    # bf16's rounding of the probabilities (2^-9 relative) is the only rounding left beyond fp32:
    # measured max 0.0016-0.0034 where torch's bf16 SDPA (output rounded to bf16 too) is 0.004-0.008
    assert err.max().item() < 6e-3, err.max()
    assert err.mean().item() < 1e-3, err.mean()


# 6-row register tiles, 12-row items, 16-key blocks, 64-key passes of P V
@pytest.mark.parametrize("n, prefix", [(1, 0), (5, 0), (6, 0), (7, 3), (12, 0), (13, 15), (63, 1), (64, 64),
                                       (65, 130), (200, 37)])
@pytest.mark.parametrize("heads, kv_heads, d", [*SHAPES, (2, 1, 16)])
def test_f32_kernel_agrees_with_a_float64_reference(n, prefix, heads, kv_heads, d):
    attend = kernel_for(F32)
    q, keys, values = inputs(n, prefix, heads, kv_heads, d, torch.float32, n * 1000 + prefix)
    got = attend(q, keys, values, prefix)
    assert got.dtype == torch.float32 and got.shape == (n, heads, d)
    want = reference(q, keys, values, prefix)
    err = (got.double() - want).abs().max().item()
    # fp32 rounding only: measured up to ~4e-6 here, SDPA's fp32 flash kernel ~2e-6
    torch_err = (sdpa(q, keys, values, prefix).double() - want).abs().max().item()
    assert err < 2e-5 and err < 4 * torch_err + 1e-6, (err, torch_err)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_read_as_they_are(attend, dtype):
    """fp16 pools (the CPU default) and bf16 tensors: the same numbers as their fp32 values."""
    q, keys, values = inputs(40, 70, 9, 3, 64, dtype, 7)
    got = attend(q.to(dtype), keys, values, 70)
    assert torch.equal(got, attend(q.to(dtype).float(), keys.float(), values.float(), 70))


def test_strided_keys_and_values(attend):
    """The engine passes a gathered copy's ``[L, kv_heads, d]`` transposed view: any strides but the last."""
    q, keys, values = inputs(33, 20, 9, 3, 64, torch.float16, 3)
    wide_k = torch.zeros(keys.shape[1], keys.shape[0], 64, dtype=keys.dtype)
    wide_v = torch.zeros_like(wide_k)
    wide_k.copy_(keys.transpose(0, 1)), wide_v.copy_(values.transpose(0, 1))
    strided_k, strided_v = wide_k.transpose(0, 1), wide_v.transpose(0, 1)
    assert not strided_k.is_contiguous()
    assert torch.equal(attend(q, strided_k, strided_v, 20), attend(q, keys, values, 20))


def test_causal_exactly(attend):
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


def test_refusals(attend):
    q, keys, values = inputs(8, 0, 9, 3, 64, torch.float32, 0)
    with pytest.raises(RuntimeError, match="prefix \\+ n rows"):
        attend(q, keys[:7], values[:7], 0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        attend(q[:, :8], keys, values, 0)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of (16|32), at most 256"):
        attend(q[..., :40].contiguous(), keys[..., :40].contiguous(), values[..., :40].contiguous(), 0)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        attend(q.double(), keys, values, 0)


@pytest.mark.parametrize("prefix", [0, 40])
def test_the_native_backend_attends_fp32_chunks_with_the_f32_kernel(prefix):
    """A float32 step of one prefill chunk (37 tokens after ``prefix`` cached ones, over an fp16
    pool, the CPU default) on the ``native`` backend: its output is the kernel's over the context
    as the pool holds it, bit for bit; the ``torch`` backend's (SDPA) is the same up to rounding."""
    from engine.attention import AttentionMetadata, PrefillChunk, TorchAttention
    from engine.attention.native import NativeAttention

    attend = kernel_for(F32)
    heads, kv_heads, d, bs, n = 9, 3, 64, 16, 37
    context = prefix + n
    gen = torch.Generator().manual_seed(prefix)
    k_cache = torch.zeros(8, bs, kv_heads, d, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k_cache.view(-1, kv_heads, d)[:prefix] = torch.randn(prefix, kv_heads, d, generator=gen).half()
    v_cache.view(-1, kv_heads, d)[:prefix] = torch.randn(prefix, kv_heads, d, generator=gen).half()
    q = torch.randn(n, heads, d, generator=gen)
    k, v = (torch.randn(n, kv_heads, d, generator=gen) for _ in range(2))
    blocks = torch.arange(-(-context // bs)) if prefix else None
    meta = AttentionMetadata(slot_mapping=prefix + torch.arange(n), decode_groups=[],
                             prefills=[PrefillChunk(0, n, context, blocks, None)])

    def run(attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kc, vc = k_cache.clone(), v_cache.clone()
        return attn.forward(q, k, v, kc, vc, meta).view(n, heads, d), kc, vc

    native, k_pool, v_pool = run(NativeAttention())
    keys = k_pool.view(-1, kv_heads, d)[:context]
    values = v_pool.view(-1, kv_heads, d)[:context]
    assert torch.equal(native, attend(q, keys, values, prefix))
    torch_out, _, _ = run(TorchAttention())
    assert (native - torch_out).abs().max().item() < 1e-5
