"""The fp32 prefill attention kernel (``prefill_attention_f32``, engine/kernels/cpu/prefill_attention_f32.cpp)
against a float64 reference: every 6-row register tile, 12-row item, 16-key block and 64-key chunk
boundary, grouped heads, a cached prefix, fp32 / fp16 / bf16 and strided inputs; causality exactly
(later keys change nothing before them); its refusals; and that the ``native`` backend sends fp32
chunks to it. Runs where the CPU has AVX2, FMA and F16C (every x86 CPU the int8 kernels run on)."""
from __future__ import annotations

import pytest
import torch

from engine.attention.native import native_prefill_runs
from engine.attention.torch_sdpa import attend_after_prefix
from tests.engine.attention.test_prefill_precision import reference  # float64 causal attention
from tests.engine.kernels.test_prefill_attention_kernel import inputs
from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()
    if not native_prefill_runs(64, torch.float32):
        pytest.skip("no AVX2 on this CPU: fp32 prefill chunks attend through SDPA")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    return torch.ops.kvserve.prefill_attention_f32(q, keys, values, prefix, q.shape[-1] ** -0.5)


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    """The path it replaces (TorchAttention._prefill on the CPU), in fp32."""
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.float().transpose(0, 1).unsqueeze(0)
    return attend_after_prefix(heads_first(q), heads_first(keys), heads_first(values), prefix)[0].transpose(0, 1)


@pytest.mark.parametrize("n, prefix", [(1, 0), (5, 0), (6, 0), (7, 3), (12, 0), (13, 15), (63, 1), (64, 64),
                                       (65, 130), (200, 37)])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 16)])
def test_agrees_with_a_float64_reference(n, prefix, heads, kv_heads, d):
    q, keys, values = inputs(n, prefix, heads, kv_heads, d, torch.float32, n * 1000 + prefix)
    got = attend(q, keys, values, prefix)
    assert got.dtype == torch.float32 and got.shape == (n, heads, d)
    want = reference(q, keys, values, prefix)
    err = (got.double() - want).abs().max().item()
    # fp32 rounding only: measured up to ~4e-6 here, SDPA's fp32 flash kernel ~2e-6
    torch_err = (sdpa(q, keys, values, prefix).double() - want).abs().max().item()
    assert err < 2e-5 and err < 4 * torch_err + 1e-6, (err, torch_err)


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
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attend(q[..., :40].contiguous(), keys[..., :40].contiguous(), values[..., :40].contiguous(), 0)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        attend(q.double(), keys, values, 0)


@pytest.mark.parametrize("prefix", [0, 40])
def test_the_native_backend_attends_fp32_chunks_with_it(prefix):
    """A float32 step of one prefill chunk (37 tokens after ``prefix`` cached ones, over an fp16
    pool, the CPU default) on the ``native`` backend: its output is the kernel's over the context
    as the pool holds it, bit for bit; the ``torch`` backend's (SDPA) is the same up to rounding."""
    from engine.attention import AttentionMetadata, PrefillChunk, TorchAttention
    from engine.attention.native import NativeAttention

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
