"""The pool of physical KV blocks and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from cache.block import KVBlock
from cache.free_queue import FreeBlockQueue
from cache.hashing import BlockHash


class BlockPool:
    """Owns all KVBlocks. A block with ref_cnt == 0 is in the free queue. Unhashed free blocks sit
    at the head (reused first); hashed free blocks (evictable prefix-cache entries) are appended
    at the tail, so the head of the hashed section is the least recently freed = LRU. A hashed
    block is evicted lazily: only when popped for reuse is its hash dropped from the cache map.

    Invariants: ``blocks[i].block_id == i``; ref_cnt == 0 <=> in the free queue; a block has a
    hash <=> the cache map sends that hash to it (the map is a bijection on hashed blocks); the
    count of hashed free blocks is kept as blocks enter and leave the queue (every step's stats
    read it, and counting would walk every hashed block of the pool).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self._num_cached_free = 0  # hashed blocks with ref_cnt == 0
        # When not None, every hashed block evicted for reuse is recorded here as (block_id, hash),
        # so its contents can be copied to a lower tier before they are overwritten.
        self.evicted: list[tuple[int, BlockHash]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0 (including evictable cached ones)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Hashed blocks with ref_cnt == 0: evictable, kept for reuse."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue with ref_cnt = 1, evicting their hashes.

        ValueError (and nothing changes) if fewer than ``n`` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        new_blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in new_blocks:
            if block.block_hash is not None:
                if self.evicted is not None:
                    self.evicted.append((block.block_id, block.block_hash))
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_cnt = 1
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a held block under ``block_hash``; True if the map now sends the hash to it.

        Returns False, leaving the block unhashed, if the hash already maps to another block (the
        same content was computed twice concurrently) or if prefix caching is disabled.
        """
        if not self.enable_prefix_caching:
            return False
        if block.ref_cnt == 0:
            # A free unhashed block sits at the queue head; hashing it there would break the LRU order.
            raise ValueError(f"cannot cache free block {block.block_id}")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return True
        if block_hash in self.cached_blocks:
            return False
        self.cached_blocks[block_hash] = block
        block.block_hash = block_hash
        return True

    def uncache_block(self, block: KVBlock) -> None:
        """Drop a held block's hash (its content changed: a re-rotated block, cache/eviction)."""
        if block.ref_cnt == 0:
            raise ValueError(f"cannot uncache free block {block.block_id}")
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the given order.

        A block reaching ref_cnt 0 goes to the tail if hashed (LRU entry) or to the head if not
        (reused first). ValueError on a block that is already free.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                    self._num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. False (and nothing changes) while any block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self._num_cached_free = 0
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's internal state is inconsistent (tests/debug)."""
        queued = list(self.free_queue)
        _check(len(queued) == len(self.free_queue), "free queue length disagrees with its links")
        prev: KVBlock | None = None
        for block in queued:
            _check(prev is None or block.prev_free is prev, f"broken back link at block {block.block_id}")
            prev = block
        queued_ids = {block.block_id for block in queued}
        _check(len(queued_ids) == len(queued), "a block appears twice in the free queue")
        for i, block in enumerate(self.blocks):
            _check(block.block_id == i, f"blocks[{i}] has block_id {block.block_id}")
            _check(block.ref_cnt >= 0, f"block {i} has negative ref_cnt {block.ref_cnt}")
            in_queue = block.block_id in queued_ids
            _check(in_queue == (block.ref_cnt == 0),
                   f"block {i}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue}")
            if not in_queue:
                _check(block.prev_free is None and block.next_free is None,
                       f"held block {i} still has free-queue links")
            if block.block_hash is not None:
                _check(self.cached_blocks.get(block.block_hash) is block,
                       f"block {i} has a hash that the cache map does not send to it")
        for block_hash, block in self.cached_blocks.items():
            _check(block.block_hash == block_hash, f"cache map entry for block {block.block_id} is stale")
            _check(self.blocks[block.block_id] is block, "cache map holds a foreign block")
        _check(self.enable_prefix_caching or not self.cached_blocks, "hashes cached with caching disabled")
        counted = sum(1 for block in self.cached_blocks.values() if block.ref_cnt == 0)
        _check(self._num_cached_free == counted,
               f"{self._num_cached_free} hashed free blocks counted, {counted} in the pool")


def _check(condition: bool, message: str) -> None:
    # Explicit raise rather than `assert`, so the checks still run under `python -O`.
    if not condition:
        raise AssertionError(message)
