"""Per-request block tables on top of the BlockPool, with prefix caching."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cache.block import KVBlock
from cache.block_pool import BlockPool, _check
from cache.hashing import BlockHash, iter_block_hashes


class CacheRequest(Protocol):
    """What the manager reads of a scheduler Request (read-only)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt + output tokens so far (the known tokens)."""
        ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is already in this request's blocks."""
        ...

    @property
    def cache_salt(self) -> str | None: ...


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    # Chained hashes of blocks[:len(block_hashes)]. A block may be missing from the cache map (a
    # duplicate of another request's block) but its hash is still needed to chain the next one.
    block_hashes: list[BlockHash] = field(default_factory=list)


class KVCacheManager:
    """Maps request ids to their blocks; hands out prefix-cache hits and new blocks.

    Block ``i`` of a request holds the KV of token positions ``[i*block_size, (i+1)*block_size)``.
    Every block of a request that is full of known tokens is registered in the prefix cache
    (unless the same content is already registered), so prompt and decode blocks alike become
    reusable once the request frees them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_held(self) -> int:
        """Blocks held by at least one live request."""
        return self.num_blocks - self.num_free_blocks

    def get_computed_blocks(self, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVBlock], int]:
        """Longest chain of prefix-cache hits over the full blocks of ``token_ids``.

        Stops at the first miss and never covers the last token (its logits are needed), so at
        most ``(len(token_ids) - 1) // block_size`` blocks. Returns ``(blocks, len(blocks) *
        block_size)``. The blocks are NOT touched: pass them to ``allocate_slots`` in the same
        scheduling step, before anything else can evict them.
        """
        if not self.enable_prefix_caching or not token_ids:
            return [], 0
        max_hit_tokens = (len(token_ids) - 1) // self.block_size * self.block_size
        hits: list[KVBlock] = []
        for block_hash in iter_block_hashes(token_ids[:max_hit_tokens], self.block_size, cache_salt):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Make the request's blocks hold ``num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens; return the newly allocated blocks.

        ``new_computed_blocks`` (from ``get_computed_blocks``, only while the request holds no
        blocks) are touched and become its first blocks. Returns None, changing nothing, if the
        pool cannot supply the blocks. Afterwards every block full of known tokens is hashed and
        registered in the prefix cache.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id, _RequestBlocks())
        if new_computed_blocks and state.blocks:
            raise ValueError("new_computed_blocks are only allowed on a request's first allocation")
        if request.num_computed_tokens > len(state.blocks) * self.block_size:
            raise ValueError(f"request {request.request_id!r} claims {request.num_computed_tokens} "
                             f"computed tokens but holds only {len(state.blocks)} blocks")

        num_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(state.blocks) - len(new_computed_blocks))
        # Touching a hit with ref_cnt 0 takes it out of the free queue, so it costs a free block too.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None

        # Hash before mutating anything, so a stale hit is reported with the pool untouched.
        num_full_blocks = min(num_tokens, len(request.all_token_ids)) // self.block_size
        new_hashes = self._hash_blocks(request, state, num_full_blocks)
        for i, block in enumerate(new_computed_blocks):
            if i >= len(new_hashes) or block.block_hash != new_hashes[i]:
                raise ValueError(f"new_computed_blocks[{i}] (block {block.block_id}) is not a cache "
                                 "hit for this request's tokens (evicted since get_computed_blocks?)")

        self.block_pool.touch(new_computed_blocks)
        state.blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        state.blocks.extend(new_blocks)
        for block_hash in new_hashes:
            block = state.blocks[len(state.block_hashes)]
            state.block_hashes.append(block_hash)
            self.block_pool.cache_block(block, block_hash)  # False for a duplicate: stays unhashed
        self._requests[request.request_id] = state
        return new_blocks

    def _hash_blocks(self, request: CacheRequest, state: _RequestBlocks,
                     num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the request's full blocks not hashed yet (incremental along the chain)."""
        start = len(state.block_hashes)
        if not self.enable_prefix_caching or num_full_blocks <= start:
            return []
        parent = state.block_hashes[-1] if state.block_hashes else None
        return list(iter_block_hashes(request.all_token_ids[:num_full_blocks * self.block_size],
                                      self.block_size, request.cache_salt, parent, start))

    def free(self, request_id: str) -> None:
        """Release the request's blocks and forget it; unknown ids are a no-op.

        Blocks are freed tail first, so within a request the deepest blocks (least likely to be
        shared by other prompts) land earlier in the LRU order and are evicted first.
        """
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        """The request's blocks in token order ([] for an unknown id); a copy."""
        state = self._requests.get(request_id)
        return list(state.blocks) if state is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.get_blocks(request_id)]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changes) while any request holds blocks."""
        # Requests still registered hold no blocks, hence no hashes: nothing to clear here.
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError unless pool and block tables agree (scheduler tests call it every step).

        Each block is either free (ref 0, in the queue) or held (ref > 0, not queued); free + held
        == total; ref_cnt == number of requests whose block list contains it; hashed blocks and
        the cache map agree both ways; each request's recorded hashes match its hashed blocks.
        """
        self.block_pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            ids = [block.block_id for block in state.blocks]
            _check(len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice: {ids}")
            holders.update(ids)
            _check(len(state.block_hashes) <= len(state.blocks),
                   f"request {request_id!r} has more hashes than blocks")
            for block, block_hash in zip(state.blocks, state.block_hashes, strict=False):
                _check(block.block_hash in (None, block_hash),
                       f"request {request_id!r}: block {block.block_id} is cached under a different hash")
        for block in self.block_pool.blocks:
            _check(block.ref_cnt == holders[block.block_id],
                   f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders")
        num_held = sum(1 for block in self.block_pool.blocks if block.ref_cnt > 0)
        _check(self.num_free_blocks + num_held == self.num_blocks, "free + held != total blocks")
