"""FreeBlockQueue and BlockPool: exact ids, ref counts and queue order."""

import pytest

from cache.block import KVBlock
from cache.block_pool import BlockPool
from cache.free_queue import FreeBlockQueue
from cache.hashing import hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def h(n: int) -> bytes:
    return hash_block_tokens(None, [n])


def test_free_queue_operations():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    q.append(blocks[4])
    assert ids(q) == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    assert ids(q) == [0, 1, 3, 4]
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    for _ in range(4):
        q.popleft()
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])


def test_block_repr_does_not_follow_links():
    q = FreeBlockQueue([KVBlock(i) for i in range(3)])
    assert repr(next(iter(q))) == "KVBlock(block_id=0, ref_cnt=0, block_hash=None)"


def test_pool_allocate_free_and_lru_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)
    assert pool.cache_block(a[0], h(0)) and pool.cache_block(a[1], h(1))
    pool.free_blocks([a[2], a[1], a[0]])
    # unhashed block 2 at the head, hashed 1 then 0 at the tail (LRU first)
    assert ids(pool.free_queue) == [2, 3, 4, 5, 1, 0]
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 6
    assert pool.get_cached_block(h(1)) is a[1]

    new = pool.get_new_blocks(5)
    assert ids(new) == [2, 3, 4, 5, 1]
    assert pool.get_cached_block(h(1)) is None and a[1].block_hash is None  # evicted lazily now
    assert pool.get_cached_block(h(0)) is a[0] and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_touch_takes_cached_block_out_of_queue():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(7))
    pool.free_blocks([b])
    assert ids(pool.free_queue) == [1, 2, 3, 0]
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 2 and ids(pool.free_queue) == [1, 2, 3]
    pool.free_blocks([b])
    assert ids(pool.free_queue) == [1, 2, 3]  # still held once
    pool.free_blocks([b])
    assert ids(pool.free_queue) == [1, 2, 3, 0] and b.block_hash == h(7)
    pool.check_invariants()


def test_get_new_blocks_too_many_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert ids(pool.free_queue) == [2]
    pool.check_invariants()


def test_cache_block_duplicate_hash_returns_false():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, h(1)) is True
    assert pool.cache_block(y, h(1)) is False
    assert y.block_hash is None and pool.get_cached_block(h(1)) is x
    assert pool.cache_block(x, h(1)) is True  # idempotent
    with pytest.raises(ValueError):
        pool.cache_block(x, h(2))  # a block has exactly one content
    pool.free_blocks([y, x])
    assert ids(pool.free_queue) == [1, 2, 3, 0]  # duplicate y is unhashed: reused first
    pool.check_invariants()


def test_cache_block_disabled():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_block(b, h(1)) is False
    assert b.block_hash is None and pool.get_cached_block(h(1)) is None


def test_double_free_is_rejected():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False  # a is still held
    assert pool.get_cached_block(h(1)) is a and pool.get_cached_block(h(2)) is b
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and a.block_hash is None and b.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    pool.check_invariants()


def test_check_invariants_detects_corruption():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # held-looking block (not queued) with ref 0
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_cached_block_count_follows_every_path_in_and_out_of_the_queue():
    """The count of hashed free blocks is kept, not recounted: freed hashed blocks add one, a
    prefix hit (touch) and an eviction (get_new_blocks) take one, unhashed blocks never count,
    a reset clears it; check_invariants recounts it after every operation."""
    pool = BlockPool(6)
    a = pool.get_new_blocks(4)
    for i, block in enumerate(a[:3]):
        assert pool.cache_block(block, h(i))
    pool.check_invariants()
    assert pool.num_cached_blocks == 0  # hashed but held
    pool.free_blocks(a)  # three hashed to the tail, one unhashed to the head
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 6
    pool.check_invariants()
    pool.touch([a[1]])  # a prefix hit takes a cached block out of the queue
    assert pool.num_cached_blocks == 2
    pool.touch([a[1]])  # a second reference: still held, still not counted
    assert pool.num_cached_blocks == 2
    pool.check_invariants()
    new = pool.get_new_blocks(4)  # 3 unhashed first (ids 3, 4, 5), then the LRU hashed block 0
    assert ids(new) == [3, 4, 5, 0] and pool.num_cached_blocks == 1 and a[0].block_hash is None
    pool.check_invariants()
    pool.free_blocks(new + [a[1], a[1]])
    assert pool.num_cached_blocks == 2  # a[1] and a[2]; the evicted block 0 came back unhashed
    pool.check_invariants()
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_check_invariants_catches_a_wrong_cached_count():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.cache_block(blocks[0], h(0))
    pool.free_blocks(blocks)
    pool._num_cached_free = 0
    with pytest.raises(AssertionError, match="hashed free blocks"):
        pool.check_invariants()
