"""The device KV pool: its tensors and what a token of it costs.

Layout: one (K, V) pair per layer, each ``[num_blocks + 1, block_size, kv_heads, head_dim]``;
block ``num_blocks`` is the sink that padded CUDA-graph rows write to (never handed to the
cache manager). A float pool holds ``kv_pool_dtype`` values; an ``int8`` pool holds ``Int8KV``
(int8 codes plus a float32 (step, minimum) per token and head: engine/kv/int8.py); an ``int4``
pool holds ``Int4KV`` (KIVI: 4-bit keys per channel and block, values per token, and one
``Int4Residual`` of open blocks in the model's dtype shared by every layer: engine/kv/int4.py).

``kv_bytes_per_token`` is the one formula for what a token costs in every KV dtype; the engine
sizes its pool with it and reports it (``EngineInfo.kv_bytes_per_token``). ``kv_fixed_bytes`` is
what a pool costs besides its blocks (int4's residual), which ``num_blocks_for_budget`` takes off
the budget first.
"""
from __future__ import annotations

import torch

from cache.memory import kv_bytes_per_token as _kv_bytes
from cache.memory import num_blocks_for_memory
from engine.kv.int4 import Int4KV, Int4Residual, int4_bytes_per_token_head, residual_bytes
from engine.kv.int8 import SCALE_BYTES, Int8KV
from engine.platform import huge_pages

KVTensor = torch.Tensor | Int8KV | Int4KV
KVPool = list[tuple[KVTensor, KVTensor]]  # per layer: (K, V)


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a float KV pool: fp16 for ``float16``, else the model's dtype (an
    ``int8`` pool holds int8 codes plus scales: engine/kv/int8.py)."""
    return torch.float16 if kv_cache_dtype == "float16" else model_dtype


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                       model_dtype: torch.dtype, block_size: int | None = None) -> int:
    """Bytes of K and V one token occupies across all layers in a pool of ``kv_cache_dtype``
    (``auto``: the model's dtype; ``float16``; ``int8``: one byte a value plus ``SCALE_BYTES``
    per token and head; ``int4``: engine/kv/int4.py, which needs ``block_size``). ``num_kv_heads``
    is the KV heads the pool holds (one rank's on a GPU under tensor parallelism)."""
    if kv_cache_dtype == "int4":
        if block_size is None:
            raise ValueError("int4 KV bytes per token depend on the block size")
        return num_layers * num_kv_heads * int4_bytes_per_token_head(block_size, head_dim)
    if kv_cache_dtype == "int8":
        return _kv_bytes(num_layers, num_kv_heads, head_dim, 1, scale_bytes=SCALE_BYTES)
    return _kv_bytes(num_layers, num_kv_heads, head_dim, kv_pool_dtype(kv_cache_dtype, model_dtype).itemsize)


def kv_fixed_bytes(kv_cache_dtype: str, residual_slots: int, block_size: int, num_layers: int,
                   num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
    """Bytes a pool takes besides its blocks: int4's residual (engine/kv/int4.py), else 0."""
    if kv_cache_dtype != "int4":
        return 0
    return residual_bytes(residual_slots, block_size, num_layers, num_kv_heads, head_dim, model_dtype)


def num_blocks_for_budget(budget_bytes: int, block_size: int, per_token: int, fixed_bytes: int) -> int:
    """Whole blocks that fit in ``budget_bytes`` once the pool's fixed part is taken off."""
    if fixed_bytes >= budget_bytes:
        raise ValueError(f"the KV budget ({budget_bytes} bytes) does not hold the int4 residual "
                         f"({fixed_bytes} bytes): raise the KV memory or lower max_num_seqs")
    return num_blocks_for_memory(budget_bytes - fixed_bytes, block_size, per_token)


def allocate_kv_pair(shape: tuple[int, ...], kv_cache_dtype: str, model_dtype: torch.dtype,
                     device: torch.device, residual: Int4Residual | None = None) -> tuple[KVTensor, KVTensor]:
    """One layer's zeroed K and V pools of ``shape``. Zeroed, not empty: masked-out slots still
    enter the matmul and NaN * 0 is NaN. ``residual``: an int4 pool's shared open blocks."""
    if kv_cache_dtype == "int4":
        assert residual is not None, "an int4 pool needs its Int4Residual"
        return (Int4KV.zeros(shape, True, residual, model_dtype, device),
                Int4KV.zeros(shape, False, residual, model_dtype, device))
    if kv_cache_dtype == "int8":  # quantized on write, scales per token and head (engine/kv/int8.py)
        return Int8KV.zeros(shape, model_dtype, device), Int8KV.zeros(shape, model_dtype, device)
    dtype = kv_pool_dtype(kv_cache_dtype, model_dtype)
    # on a CPU, on huge pages (engine/platform/huge_pages.py): attention streams the pool every step
    return huge_pages.zeros_on(device, shape, dtype), huge_pages.zeros_on(device, shape, dtype)


def allocate_kv_pool(num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device,
                     residual_slots: int = 0) -> KVPool:
    """``num_blocks`` blocks for the cache manager plus the sink block (index ``num_blocks``);
    an int4 pool also gets ``residual_slots`` open blocks (its ``Int4Residual``, reachable as
    ``pool[0][0].state``)."""
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    residual = (Int4Residual.create(residual_slots, num_blocks + 1, block_size, device)
                if kv_cache_dtype == "int4" else None)
    return [allocate_kv_pair(shape, kv_cache_dtype, model_dtype, device, residual) for _ in range(num_layers)]
