"""A prefill chunk after a prefix (chunked prefill, prefix-cache hits) on the CPU: two flash calls
merged by their log-sum-exps (``attend_after_prefix``) equal SDPA under the chunk's mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_sdpa import attend_after_prefix


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("prefix, n", [(1, 1), (5, 3), (200, 64), (37, 300)])
def test_equals_the_masked_sdpa(heads, kv_heads, prefix, n):
    gen = torch.Generator().manual_seed(prefix + n + heads)
    q = torch.randn(1, heads, n, 32, generator=gen)
    keys = torch.randn(1, kv_heads, prefix + n, 32, generator=gen) * 2
    values = torch.randn(1, kv_heads, prefix + n, 32, generator=gen)
    # PrefillChunk.mask: the query at position p sees keys 0..p
    mask = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    got = attend_after_prefix(q.transpose(1, 2).contiguous().transpose(1, 2), keys, values, prefix)  # q as a view, as the backend passes it
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the prefix is seen: dropping it changes the result
    alone = F.scaled_dot_product_attention(q, keys[:, :, prefix:], values[:, :, prefix:], is_causal=True,
                                           enable_gqa=True)
    assert (alone - want).abs().max() > 1e-3


def test_no_prefix_is_the_causal_sdpa():
    """Prefix 0 (the runner passes block_ids only after a prefix, but the helper must not crash:
    CPU flash attention over zero keys raised SIGFPE) is plain causal attention."""
    gen = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(1, h, 5, 16, generator=gen) for h in (6, 2, 2))
    want = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attend_after_prefix(q, keys, values, 0), want)
