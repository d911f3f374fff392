"""KV memory accounting and CacheConfig validation."""

import pytest

from cache.config import CacheConfig
from cache.memory import KVCapacity, kv_bytes_per_token, num_blocks_for_memory

GIB = 2**30


def test_smollm2_bytes_per_token_is_gqa_aware():
    # SmolLM2-135M: 30 layers, 9 query heads but 3 KV heads, head_dim 64, fp32.
    assert kv_bytes_per_token(30, 3, 64, 4) == 46080
    assert kv_bytes_per_token(30, 9, 64, 4) == 3 * 46080  # what MHA would cost
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040


def test_budget_to_blocks():
    assert num_blocks_for_memory(GIB, 16, 46080) == 1456  # 1 GiB / 737280 B per block = 1456.35
    assert num_blocks_for_memory(16 * 46080 - 1, 16, 46080) == 0
    assert num_blocks_for_memory(16 * 46080, 16, 46080) == 1
    with pytest.raises(ValueError):
        num_blocks_for_memory(GIB, 0, 46080)
    with pytest.raises(ValueError):
        kv_bytes_per_token(0, 3, 64, 4)


def test_capacity_and_describe():
    cap = KVCapacity(num_blocks=1456, block_size=16, bytes_per_token=46080)
    assert cap.num_tokens == 23296
    assert cap.total_bytes == 23296 * 46080
    assert cap.max_concurrency(8192) == pytest.approx(2.84375)
    line = cap.describe(8192)
    assert line == ("KV cache: 1456 blocks x 16 tokens = 23296 tokens, 1023.8 MiB, 46080 bytes/token, "
                    "max concurrency 2.84 at 8192 tokens/request")


def test_config_capacity_from_budget_or_explicit_blocks():
    assert CacheConfig().capacity(30, 3, 64) == KVCapacity(1456, 16, 46080)
    assert CacheConfig(kv_cache_memory_gib=0.5).capacity(30, 3, 64).num_blocks == 728
    assert CacheConfig(cache_dtype="bfloat16").capacity(30, 3, 64) == KVCapacity(2912, 16, 23040)
    assert CacheConfig(num_blocks=10, block_size=32).capacity(30, 3, 64) == KVCapacity(10, 32, 46080)
    with pytest.raises(ValueError, match="does not fit one block"):
        CacheConfig(kv_cache_memory_gib=1e-6).capacity(30, 3, 64)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": 12}, "power of two"),
    ({"block_size": True}, "block_size"),
    ({"num_blocks": 0}, "num_blocks"),
    ({"num_blocks": 2.5}, "num_blocks"),
    ({"kv_cache_memory_gib": 0}, "kv_cache_memory_gib"),
    ({"kv_cache_memory_gib": float("inf")}, "kv_cache_memory_gib"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"cache_dtype": "int8"}, "cache_dtype"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(**kwargs)


def test_config_defaults_are_valid():
    cfg = CacheConfig()
    assert (cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching, cfg.dtype_bytes) == (16, None, True, 4)
    assert CacheConfig(block_size=1).block_size == 1
