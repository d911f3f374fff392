"""Lower KV-cache tiers: where hashed blocks go when the device pool evicts them.

A tier stores opaque bytes (one block's K/V of every layer, serialized by the engine) under a
block hash; it never sees tensors. Tiers sit behind one interface (``KVTier``); the engine
builds the ones its config enables (engine/builder.py). The device pool itself is tier 0 and
lives in ``BlockPool``.

``DiskTier`` contract:
  * a file is named ``sha256(fingerprint || block_hash).hex() + ".kvb"`` - never anything a
    request supplies - so a request can neither pick nor escape the folder;
  * each file carries a header (magic, fingerprint, block hash, expiry, payload length, sha256 of
    the payload); a short, corrupt or foreign file is a miss (and is deleted), never bytes
    returned for the wrong block;
  * the block hash already carries the tenant's cache salt (block 0 of the chain), and the
    fingerprint names the weights, dtypes, block size and KV dtype, so two models or two
    tenants never share an entry;
  * ``put`` returns at once: one writer thread writes a temporary file and renames it into
    place; until then ``get`` serves the pending bytes from memory;
  * LRU within ``capacity_bytes``; an entry whose ``expires_at`` (a retention deadline, wall
    clock) lies in the future is never evicted by LRU; a put that cannot fit is dropped;
  * a new ``DiskTier`` on the same folder finds the entries of the same fingerprint again.

``HostTier`` contract (``--kv-offload-gib``): a preallocated arena of fixed-size slots (one
block payload each) handed in by the engine (pinned memory when the pool is on a GPU, so the
copies to and from the device are DMA); ``put`` copies synchronously into a slot (a memcpy,
no I/O); LRU within the arena; an entry evicted from it goes to ``on_evict`` (the next tier),
not away; volatile (gone with the process); no retention protection of its own.

``TierChain`` puts the lower tiers in order (host -> disk) behind the one ``KVTier`` interface
the cache manager and the offloader see: a lookup finds a block in any member, a read tries them
in order (and promotes a block found lower down into the members above: a disk hit is also
written to the host tier), a put lands in the first and trickles down by LRU, and a retention
deadline is written through to the last (persistent) member.
"""
from cache.tiers.base import LATENCY_BUCKETS, KVTier, TierStats
from cache.tiers.chain import TierChain, tier_members
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier

__all__ = ["LATENCY_BUCKETS", "DiskTier", "HostTier", "KVTier", "TierChain", "TierStats", "tier_members"]
