"""Intrusive doubly linked list of free KV blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cache.block import KVBlock


class FreeBlockQueue:
    """Free blocks, head to tail, with O(1) popleft / append / appendleft / remove.

    The links live in the blocks themselves (``prev_free``/``next_free``) so that a prefix-cache
    hit can pull a block out of the middle in O(1). Two sentinel nodes bound the list, hence a
    block is in the queue iff its links are not None.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        """Remove and return the head block; IndexError when empty."""
        if self._len == 0:
            raise IndexError("pop from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Insert at the tail."""
        assert self._tail.prev_free is not None
        self._insert_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head."""
        assert self._head.next_free is not None
        self._insert_between(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block``; ValueError if it is not in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail (for tests and debugging)."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def _insert_between(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1
