"""The compiled Triton kernels on the GPU at real shapes (head_dim 128, 32/8 heads, 8k
contexts with split-K, bf16) against SDPA over the gathered context."""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.kernels.triton.paged_attention import paged_decode, paged_extend  # noqa: E402

CUDA = torch.device("cuda")


def reference(q, k_cache, v_cache, row, seq_len):
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[row.long()].reshape(-1, kv_heads, d)[:seq_len].float()
    v = v_cache[row.long()].reshape(-1, kv_heads, d)[:seq_len].float()
    q_len = q.shape[0]
    mask = torch.arange(seq_len, device=CUDA)[None, :] <= torch.arange(seq_len - q_len, seq_len, device=CUDA)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=True)
    return out[0].transpose(0, 1)


def pool(num_blocks, block_size, kv_heads, d, dtype):
    g = torch.Generator(device=CUDA).manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, d)
    return (torch.randn(shape, generator=g, device=CUDA).to(dtype), torch.randn(shape, generator=g, device=CUDA).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (16, 1)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_long_contexts_split_k(dtype, heads, block_size):
    num_heads, kv_heads = heads
    lens = [8000, 1, 17, 4096, 257]
    width = math.ceil(max(lens) / block_size)
    num_blocks = width * len(lens) + 1
    k_cache, v_cache = pool(num_blocks, block_size, kv_heads, 128, dtype)
    table = torch.randperm(num_blocks - 1, device=CUDA)[:width * len(lens)].view(len(lens), width).int()
    q = torch.randn(len(lens), num_heads, 128, device=CUDA).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    for splits in (None, 1, 7):
        out = paged_decode(q, k_cache, v_cache, table, seq_lens, 128 ** -0.5, max_len=8192, num_splits=splits)
        for i, n in enumerate(lens):
            torch.testing.assert_close(out[i:i + 1].float(), reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                       atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_over_cached_prefix(dtype):
    num_heads, kv_heads, block_size = 32, 8, 16
    q_lens, seq_lens = [1, 300, 1000, 77], [50, 300, 1500, 100]
    width = math.ceil(max(seq_lens) / block_size)
    k_cache, v_cache = pool(width * 4 + 1, block_size, kv_heads, 128, dtype)
    table = torch.randperm(width * 4, device=CUDA).view(4, width).int()
    starts = torch.tensor([0] + q_lens, device=CUDA).cumsum(0).int()
    q = torch.randn(int(starts[-1]), num_heads, 128, device=CUDA).to(dtype)
    out = torch.zeros_like(q)
    paged_extend(q, k_cache, v_cache, table, starts, torch.tensor(seq_lens, dtype=torch.int32, device=CUDA), out,
                 128 ** -0.5, seq_offset=1, num_seqs=3, max_query_len=1000)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    for i in range(1, 4):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows].float(), reference(q[rows], k_cache, v_cache, table[i], seq_lens[i]),
                                   atol=tol, rtol=tol)


def mass_reference(q, k_cache, v_cache, row, seq_len, block_size):
    """The torch backend's per-block mass (explicit fp32 softmax) of queries at the context's end."""
    from engine.attention.torch_sdpa import _attend_with_mass

    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[row.long()].reshape(-1, kv_heads, d)[:seq_len].float().transpose(0, 1)[None]
    values = v_cache[row.long()].reshape(-1, kv_heads, d)[:seq_len].float().transpose(0, 1)[None]
    q_len = q.shape[0]
    mask = torch.arange(seq_len, device=CUDA)[None, :] <= torch.arange(seq_len - q_len, seq_len, device=CUDA)[:, None]
    return _attend_with_mass(q.float().transpose(0, 1)[None], keys, values, mask, block_size)[1][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_block_mass_export_compiled(dtype, block_size):
    """H2O's mass export in the compiled kernels (split-K decode at 8k, an extend chunk over a
    cached prefix): the torch reference's mass per block, the outputs those of the plain launch."""
    num_heads, kv_heads, d = 32, 8, 128
    lens = [8000, 1, 17, 4096]
    width = math.ceil(max(lens) / block_size)
    k_cache, v_cache = pool(width * len(lens) + 1, block_size, kv_heads, d, dtype)
    table = torch.randperm(width * len(lens), device=CUDA).view(len(lens), width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    q = torch.randn(len(lens), num_heads, d, device=CUDA).to(dtype)
    mass = torch.zeros(len(lens), width, device=CUDA)
    out = paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5, max_len=8192, num_splits=7, block_mass=mass)
    assert torch.equal(out, paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5, max_len=8192,
                                         num_splits=7))
    for i, n in enumerate(lens):
        ref = mass_reference(q[i:i + 1], k_cache, v_cache, table[i], n, block_size)
        torch.testing.assert_close(mass[i, :len(ref)], ref, atol=1e-3, rtol=1e-2)
    # one decode row, then a 700-token chunk after a 300-token prefix
    q_lens, ext_lens = [1, 700], [50, 1000]
    starts = torch.tensor([0] + q_lens, device=CUDA).cumsum(0).int()
    qx = torch.randn(int(starts[-1]), num_heads, d, device=CUDA).to(dtype)
    outs, mass = [torch.zeros_like(qx), torch.zeros_like(qx)], torch.zeros(2, width, device=CUDA)
    for o, m in zip(outs, (mass, None)):
        paged_extend(qx, k_cache, v_cache, table[:2], starts, torch.tensor(ext_lens, dtype=torch.int32, device=CUDA),
                     o, d ** -0.5, seq_offset=1, num_seqs=1, max_query_len=700, block_mass=m)
    assert torch.equal(outs[0], outs[1]) and (mass[0] == 0).all()
    ref = mass_reference(qx[1:], k_cache, v_cache, table[1], ext_lens[1], block_size)
    torch.testing.assert_close(mass[1, :len(ref)], ref, atol=1e-2, rtol=1e-2)
