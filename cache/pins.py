"""Prompt-cache retention: per-request cache policy and the pin table.

``CachePolicy`` (``kvtypes.cache_policy``) is the value a request carries (built by the server
from ``cache_control`` / ``prompt_cache_retention`` / ``prompt_cache_key``). ``Pin`` records one
pinned prefix; the ``KVCacheManager`` owns the pins and the block references they hold.

Pin contract (enforced by the manager):
  * a pin holds one reference on each block of its prefix, so the pool never evicts them;
  * a hit that covers a pin's last block refreshes its expiry to ``now + ttl``;
  * pinned blocks (distinct) never exceed ``max_pinned_blocks``: over the cap the least recently
    refreshed pin is demoted - unpinned, and its blocks written through to the next tier;
  * an expired pin is released at the next scheduling step; under memory pressure that no
    preemption can relieve, pins are demoted too, so a pin never starves a request.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cache.hashing import BlockHash

RETENTION_SECONDS: dict[str, float | None] = {"in_memory": None, "24h": 24 * 3600.0}
PIN_TTL_SECONDS: dict[str, float] = {"5m": 300.0, "1h": 3600.0}


def salt_id(cache_salt: str | None) -> str | None:
    """A short, non-reversible id of a tenant salt for listings (the salt itself stays secret)."""
    if cache_salt is None:
        return None
    return hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:12]


@dataclass
class Pin:
    """One pinned prefix, keyed by the hash of its last block (which names the whole chain)."""

    key: BlockHash
    block_ids: tuple[int, ...]
    num_tokens: int
    ttl_s: float
    expires_at: float  # on the manager's (monotonic, injectable) clock
    last_refresh: float
    salt_id: str | None = None
    tenant: str | None = None  # whose request pinned it: listings and unpins are scoped to it


@dataclass(frozen=True)
class PinInfo:
    """A read-only snapshot of a pin for listings (safe to hand to another thread)."""

    hash: str
    num_tokens: int
    num_blocks: int
    ttl_s: float
    expires_at: float
    salt_id: str | None
    tenant: str | None = None
