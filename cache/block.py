"""The KV block record shared by the block pool, free queue and cache manager."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.hashing import BlockHash


@dataclass(eq=False)  # identity semantics: two blocks are never "equal"
class KVBlock:
    """One physical KV block (``block_size`` token slots in every layer's K and V pools).

    Invariants (maintained by BlockPool):
      * ``ref_cnt == 0``  <=> the block is in the free queue (``prev_free``/``next_free`` set);
      * ``block_hash is not None`` <=> the pool's cache map sends that hash to this block.
    """

    block_id: int
    ref_cnt: int = 0  # number of live requests holding the block
    block_hash: BlockHash | None = None  # set while registered in the prefix cache
    # Free-queue links, kept out of repr: they chain through the whole queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
