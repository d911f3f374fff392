"""The prompt-cache retention a request asks for (a plain, picklable value).

Built by the server from ``cache_control`` / ``prompt_cache_retention`` / ``prompt_cache_key``;
travels inside ``SamplingParams`` to the engine core, whose ``KVCacheManager`` enforces it
(``cache.pins`` re-exports it beside the pin table).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachePolicy:
    """What a request asks of the prompt cache beyond plain prefix caching.

    ``pin_tokens``: the prompt tokens up to the last ``cache_control`` breakpoint (its full blocks
    get pinned for ``pin_ttl_s``); ``retention_s``: keep the prompt's full blocks on the disk tier
    at least that long (write-through); ``cache_key``: recorded for routing, not interpreted.
    """

    pin_tokens: int = 0
    pin_ttl_s: float = 0.0
    retention_s: float | None = None
    cache_key: str | None = None

    def __post_init__(self) -> None:
        if self.pin_tokens < 0:
            raise ValueError(f"pin_tokens must be >= 0, got {self.pin_tokens}")
        if self.pin_tokens and self.pin_ttl_s <= 0:
            raise ValueError("a cache_control breakpoint needs a positive ttl")
        if self.retention_s is not None and self.retention_s <= 0:
            raise ValueError(f"retention_s must be positive, got {self.retention_s}")
