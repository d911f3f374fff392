"""The KV pool: its layout, and the one bytes-per-token formula against what it allocates."""
from __future__ import annotations

import pytest
import torch

from engine.kv.int8 import Int8KV
from engine.kv.pool import allocate_kv_pool, kv_bytes_per_token, kv_pool_dtype

CPU = torch.device("cpu")


def pool_bytes(pool) -> int:
    return sum(t.numel() * t.element_size() for pair in pool for c in pair
               for t in (c.tensors() if isinstance(c, Int8KV) else [c]))


@pytest.mark.parametrize("kv_cache_dtype, model_dtype", [
    ("auto", torch.float32), ("auto", torch.bfloat16), ("auto", torch.float16),
    ("float16", torch.float32), ("int8", torch.float32), ("int8", torch.bfloat16)])
def test_bytes_per_token_is_what_the_pool_allocates(kv_cache_dtype, model_dtype):
    layers, heads, head_dim, block_size, blocks = 3, 2, 16, 4, 5
    pool = allocate_kv_pool(blocks, block_size, layers, heads, head_dim, kv_cache_dtype, model_dtype, CPU)
    assert len(pool) == layers and pool[0][0].shape == (blocks + 1, block_size, heads, head_dim)  # + the sink
    per_token = kv_bytes_per_token(layers, heads, head_dim, kv_cache_dtype, model_dtype)
    assert pool_bytes(pool) == (blocks + 1) * block_size * per_token


def test_bytes_per_token_values():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
    assert kv_bytes_per_token(30, 3, 64, "auto", torch.float32) == 46080
    assert kv_bytes_per_token(30, 3, 64, "auto", torch.bfloat16) == 23040
    assert kv_bytes_per_token(30, 3, 64, "float16", torch.float32) == 23040
    # int8: one byte a value plus a float32 (step, minimum) per token, head, K and V.
    assert kv_bytes_per_token(30, 3, 64, "int8", torch.float32) == 2 * 30 * 3 * (64 + 8)
    with pytest.raises(ValueError):
        kv_bytes_per_token(0, 3, 64, "int8", torch.float32)


def test_pool_dtypes():
    assert kv_pool_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_pool_dtype("float16", torch.float32) == torch.float16
    pool = allocate_kv_pool(1, 4, 1, 1, 8, "int8", torch.bfloat16, CPU)
    k, v = pool[0]
    assert isinstance(k, Int8KV) and k.data.dtype == torch.int8 and k.out_dtype == torch.bfloat16
    assert k.scale.shape == (2, 4, 1, 2) and not k.data.any() and not v.scale.any()  # zeroed
