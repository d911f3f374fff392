"""KV cache memory accounting (pure arithmetic; the engine measures the actual budget)."""

from __future__ import annotations

from dataclasses import dataclass


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """Bytes of K and V one token occupies across all layers:
    ``2 * L * kv_heads * (head_dim * dtype_bytes + scale_bytes)``, ``scale_bytes`` being what a
    quantized pool stores per token and head beside its codes (the engine's per-KV-dtype values:
    engine/kv/pool.py).

    Uses the number of KV heads, not query heads: under GQA several query heads share one KV head.
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if scale_bytes < 0:
        raise ValueError(f"scale_bytes must be >= 0, got {scale_bytes}")
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def num_blocks_for_memory(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks fit in ``memory_bytes`` (rounded down)."""
    if memory_bytes < 0 or block_size <= 0 or bytes_per_token <= 0:
        raise ValueError(f"invalid sizes: memory_bytes={memory_bytes}, block_size={block_size}, "
                         f"bytes_per_token={bytes_per_token}")
    return memory_bytes // (block_size * bytes_per_token)


@dataclass(frozen=True)
class KVCapacity:
    """The size of an allocated KV pool."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def max_concurrency(self, max_model_len: int) -> float:
        """How many requests of ``max_model_len`` tokens fit at once (without prefix sharing)."""
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        return self.num_tokens / max_model_len

    def describe(self, max_model_len: int) -> str:
        """One log line with the capacity numbers."""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} "
                f"tokens, {self.total_bytes / 2**20:.1f} MiB, {self.bytes_per_token} bytes/token, "
                f"max concurrency {self.max_concurrency(max_model_len):.2f} at {max_model_len} "
                "tokens/request")
