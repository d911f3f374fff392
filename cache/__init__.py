"""Paged KV cache bookkeeping: block pool, prefix cache, per-request block tables.

Pure Python (stdlib only): no torch, no engine/scheduler/server imports. The model runner owns
the actual K/V tensors; this package only decides which block ids hold which tokens.
"""

from cache.block import KVBlock
from cache.block_pool import BlockPool
from cache.config import DTYPE_BYTES, CacheConfig
from cache.free_queue import FreeBlockQueue
from cache.hashing import BlockHash, hash_block_tokens, hash_full_blocks, iter_block_hashes
from cache.kv_cache_manager import CacheRequest, KVCacheManager
from cache.memory import KVCapacity, kv_bytes_per_token, num_blocks_for_memory

__all__ = [
    "DTYPE_BYTES",
    "BlockHash",
    "BlockPool",
    "CacheConfig",
    "CacheRequest",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCapacity",
    "hash_block_tokens",
    "hash_full_blocks",
    "iter_block_hashes",
    "kv_bytes_per_token",
    "num_blocks_for_memory",
]
