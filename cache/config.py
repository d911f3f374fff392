"""KV cache configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cache.eviction.config import EvictionConfig
from cache.memory import KVCapacity, kv_bytes_per_token, num_blocks_for_memory

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "float16", "float32", "int4")  # --kv-cache-dtype


@dataclass
class CacheConfig:
    """How big the KV pool is and how it is used. Validated on construction (ValueError)."""

    block_size: int = 16
    num_blocks: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_memory_gib: float = 1.0  # budget used when num_blocks is None
    enable_prefix_caching: bool = True
    cache_dtype: str | None = None  # KV element type; None: the model's dtype (the engine allows no other)
    # "auto": float16 on the CPU under a float32 model (llama.cpp's default KV type), else the
    # model's dtype (resolved by engine.builder.resolve_kv_dtype); "float32": fp32 blocks under a
    # float32 model (the exact option); "int8": quantized KV blocks with per-token-per-head
    # scales; "float16": fp16 blocks under a float32 model (half the bytes);
    # "int4": KIVI blocks (keys per channel and block, values per token; engine/kv/int4.py)
    kv_cache_dtype: str = "auto"
    # Disk tier (cache/tiers.py): evicted hashed blocks are written here; None disables it.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 4.0
    # Host tier (cache/tiers.py HostTier): GiB of host memory for evicted blocks, before the disk
    # tier; 0 disables it. Pinned memory on GPU; on CPU it duplicates what the pool already is.
    kv_offload_gib: float = 0.0
    # Pinned prefixes (cache_control) may hold at most this fraction of the pool.
    kv_pin_fraction: float = 0.25
    # Eviction inside a sequence (cache/eviction): "none", "streaming" (sinks + a recent window) or
    # "h2o" (sinks + recent + heavy hitters within a budget);
    # None window: the largest that fits the context; None cap: a request's prompt + output unbounded.
    kv_eviction: str = "none"
    kv_sink_tokens: int = 4
    kv_window_tokens: int | None = None
    kv_max_request_tokens: int | None = None
    # h2o: tokens a sequence holds before a step (whole blocks) and the recent ones always kept
    # (None: half of what the budget leaves beside the sinks and the open block).
    kv_budget_tokens: int | None = None
    kv_recent_tokens: int | None = None

    def __post_init__(self) -> None:
        bs = self.block_size
        if not _is_int(bs) or bs <= 0 or bs & (bs - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks <= 0):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        gib = self.kv_cache_memory_gib
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be a positive number, got {gib!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        disk = self.kv_disk_gib
        if isinstance(disk, bool) or not isinstance(disk, (int, float)) or not math.isfinite(disk) or disk <= 0:
            raise ValueError(f"kv_disk_gib must be a positive number, got {disk!r}")
        off = self.kv_offload_gib
        if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off) or off < 0:
            raise ValueError(f"kv_offload_gib must be a number >= 0, got {off!r}")
        if self.kv_disk_dir is not None and (not isinstance(self.kv_disk_dir, str) or not self.kv_disk_dir):
            raise ValueError(f"kv_disk_dir must be a folder path, got {self.kv_disk_dir!r}")
        frac = self.kv_pin_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ValueError(f"kv_pin_fraction must be in [0, 1), got {frac!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.cache_dtype is not None and self.cache_dtype not in DTYPE_BYTES:
            raise ValueError(f"cache_dtype must be one of {sorted(DTYPE_BYTES)}, got {self.cache_dtype!r}")
        self.eviction  # noqa: B018  (validates the kv_eviction fields)

    @property
    def eviction(self) -> EvictionConfig:
        """The ``kv_eviction`` fields as one (unresolved) config; ValueError naming a bad field."""
        return EvictionConfig(policy=self.kv_eviction, sink_tokens=self.kv_sink_tokens,
                              window_tokens=self.kv_window_tokens, max_request_tokens=self.kv_max_request_tokens,
                              block_size=self.block_size, budget_tokens=self.kv_budget_tokens,
                              recent_tokens=self.kv_recent_tokens)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per KV element (fp32 when ``cache_dtype`` is unset and no model says otherwise)."""
        return DTYPE_BYTES[self.cache_dtype or "float32"]

    def capacity(self, num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: str = "float32") -> KVCapacity:
        """Pool size for a model: ``num_blocks`` if set, else what fits in the memory budget.

        The engine's one source of its pool size. ValueError if the budget does not fit a single block.
        """
        bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, DTYPE_BYTES[self.cache_dtype or model_dtype])
        num_blocks = self.num_blocks
        if num_blocks is None:
            budget = int(self.kv_cache_memory_gib * 2**30)
            num_blocks = num_blocks_for_memory(budget, self.block_size, bytes_per_token)
            if num_blocks == 0:
                raise ValueError(f"kv_cache_memory_gib={self.kv_cache_memory_gib} does not fit one block "
                                 f"of {self.block_size} tokens x {bytes_per_token} bytes/token")
        return KVCapacity(num_blocks, self.block_size, bytes_per_token)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
