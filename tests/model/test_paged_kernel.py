"""The native paged decode kernel equals gather + SDPA on the same pool, shape for shape."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def reference(q, k_cache, v_cache, tables, lens):
    """Each row gathered on its own, unpadded, through SDPA: [B, H, d]."""
    bs = k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, :(n + bs - 1) // bs]
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, kvH, n, d]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8)])
def test_matches_gather_and_sdpa(heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Lengths at and around block edges, a single token, and rows with unused table tail.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size, 7])
    width = 5
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    got = torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)


def test_shared_blocks_and_empty_batch():
    k_cache = torch.randn(8, 4, 2, 8)
    v_cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[3, 5], [3, 6]])  # a shared prefix block, as after a prefix-cache hit
    lens = torch.tensor([6, 8])
    q = torch.randn(2, 4, 8)
    got = torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, 8 ** -0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)
    empty = torch.ops.kvserve.paged_decode_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0], 1.0)
    assert empty.shape == (0, 4, 8)


def test_rejects_bad_input():
    k_cache = torch.randn(8, 4, 2, 8)
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.kvserve.paged_decode_attention(q.double(), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                                                 torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        torch.ops.kvserve.paged_decode_attention(q, k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                                                 torch.tensor([9]), 1.0)
