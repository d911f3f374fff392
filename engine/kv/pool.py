"""The device KV pool: its tensors and what a token of it costs.

Layout: one (K, V) pair per layer, each ``[num_blocks + 1, block_size, kv_heads, head_dim]``;
block ``num_blocks`` is the sink that padded CUDA-graph rows write to (never handed to the
cache manager). A float pool holds ``kv_pool_dtype`` values; an ``int8`` pool holds ``Int8KV``
(int8 codes plus a float32 (step, minimum) per token and head: engine/kv/int8.py).

``kv_bytes_per_token`` is the one formula for what a token costs in every KV dtype; the engine
sizes its pool with it and reports it (``EngineInfo.kv_bytes_per_token``).
"""
from __future__ import annotations

import torch

from cache.memory import kv_bytes_per_token as _kv_bytes
from engine.kv.int8 import SCALE_BYTES, Int8KV

KVTensor = torch.Tensor | Int8KV
KVPool = list[tuple[KVTensor, KVTensor]]  # per layer: (K, V)


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a float KV pool: fp16 for ``float16``, else the model's dtype (an
    ``int8`` pool holds int8 codes plus scales: engine/kv/int8.py)."""
    return torch.float16 if kv_cache_dtype == "float16" else model_dtype


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       model_dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers in a pool of ``kv_cache_dtype``
    (``auto``: the model's dtype; ``float16``; ``int8``: one byte a value plus ``SCALE_BYTES``
    per token and head). ``num_kv_heads`` is the KV heads the pool holds (one rank's on a GPU
    under tensor parallelism)."""
    if kv_cache_dtype == "int8":
        return _kv_bytes(num_layers, num_kv_heads, head_dim, 1, scale_bytes=SCALE_BYTES)
    return _kv_bytes(num_layers, num_kv_heads, head_dim, kv_pool_dtype(kv_cache_dtype, model_dtype).itemsize)


def allocate_kv_pair(shape: tuple[int, ...], kv_cache_dtype: str, model_dtype: torch.dtype,
                     device: torch.device) -> tuple[KVTensor, KVTensor]:
    """One layer's zeroed K and V pools of ``shape``. Zeroed, not empty: masked-out slots still
    enter the matmul and NaN * 0 is NaN."""
    if kv_cache_dtype == "int8":  # quantized on write, scales per token and head (engine/kv/int8.py)
        return Int8KV.zeros(shape, model_dtype, device), Int8KV.zeros(shape, model_dtype, device)
    dtype = kv_pool_dtype(kv_cache_dtype, model_dtype)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_pool(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> KVPool:
    """``num_blocks`` blocks for the cache manager plus the sink block (index ``num_blocks``)."""
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    return [allocate_kv_pair(shape, kv_cache_dtype, model_dtype, device) for _ in range(num_layers)]
