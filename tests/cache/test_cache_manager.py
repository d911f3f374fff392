"""KVCacheManager: scripted allocation/free sequences with literal block ids."""

from dataclasses import dataclass

import pytest

from cache.hashing import hash_full_blocks
from cache.kv_cache_manager import KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def ids(blocks):
    return [b.block_id for b in blocks]


def queue(mgr):
    return ids(mgr.block_pool.free_queue)


def refs(mgr):
    return [b.ref_cnt for b in mgr.block_pool.blocks]


def prefill(mgr, req):
    """Schedule a whole prompt like the scheduler does; returns (hit blocks, new blocks or None)."""
    hits, num_hit_tokens = mgr.get_computed_blocks(req.all_token_ids, req.cache_salt)
    new = mgr.allocate_slots(req, len(req.all_token_ids) - num_hit_tokens, hits)
    if new is not None:
        req.num_computed_tokens = len(req.all_token_ids)
    mgr.check_invariants()
    return hits, new


def decode(mgr, req, token):
    """Append one sampled token and allocate room for its KV."""
    req.all_token_ids.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    mgr.check_invariants()
    return new


def snapshot(mgr, *request_ids):
    pool = mgr.block_pool
    return (queue(mgr), refs(mgr), [b.block_hash for b in pool.blocks], dict(pool.cached_blocks),
            [mgr.get_block_ids(r) for r in request_ids], mgr.num_free_blocks)


def test_scripted_allocation_hits_and_lru_eviction():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = Req("A", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens
    hits, new = prefill(mgr, a)
    assert hits == [] and ids(new) == [0, 1, 2]
    assert refs(mgr) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert [b.block_hash is not None for b in new] == [True, True, False]
    assert queue(mgr) == [3, 4, 5, 6, 7]

    mgr.free("A")  # reverse order: 2 (unhashed) to the head, then 1, 0 to the tail
    mgr.check_invariants()
    assert queue(mgr) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert mgr.num_free_blocks == 8 and mgr.block_pool.num_cached_blocks == 2 and mgr.usage == 0

    b = Req("B", list(range(1, 9)) + [50, 51, 52])  # shares A's 2 full blocks
    hits, new = prefill(mgr, b)
    assert ids(hits) == [0, 1] and ids(new) == [2]
    assert mgr.get_block_ids("B") == [0, 1, 2]
    assert refs(mgr) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert queue(mgr) == [3, 4, 5, 6, 7] and mgr.block_pool.num_cached_blocks == 0

    c = Req("C", list(range(100, 112)))  # 12 tokens, 3 full blocks, no hit
    hits, new = prefill(mgr, c)
    assert hits == [] and ids(new) == [3, 4, 5]
    assert all(blk.block_hash is not None for blk in new)
    assert queue(mgr) == [6, 7]

    mgr.free("B")
    assert queue(mgr) == [2, 6, 7, 1, 0]
    mgr.free("C")
    assert queue(mgr) == [2, 6, 7, 1, 0, 5, 4, 3]
    assert mgr.block_pool.num_cached_blocks == 5
    mgr.check_invariants()

    # D takes the 3 unhashed blocks, then evicts the LRU hashed block: A's tail block 1.
    d = Req("D", list(range(200, 216)))
    _, new = prefill(mgr, d)
    assert ids(new) == [2, 6, 7, 1]
    assert ids(mgr.get_computed_blocks(a.all_token_ids)[0]) == [0]  # chain stops at evicted block 1

    # F evicts A's block 0, then C's tail block 5.
    f = Req("F", list(range(300, 308)))
    _, new = prefill(mgr, f)
    assert ids(new) == [0, 5]
    assert mgr.get_computed_blocks(a.all_token_ids) == ([], 0)
    assert queue(mgr) == [4, 3]

    # E hits C's blocks 3 and 4 but needs 2 more: the hits themselves are the only free blocks.
    e = Req("E", list(range(100, 113)))
    before = snapshot(mgr, "D", "F", "E")
    hits, new = prefill(mgr, e)
    assert ids(hits) == [3, 4] and new is None
    assert snapshot(mgr, "D", "F", "E") == before

    mgr.free("D")  # D's blocks 2,6,7,1 return tail first: 1, 7, 6, 2
    assert queue(mgr) == [4, 3, 1, 7, 6, 2]
    hits, new = prefill(mgr, e)
    assert ids(hits) == [3, 4] and ids(new) == [1, 7]  # evicts D's two tail blocks
    assert mgr.get_block_ids("E") == [3, 4, 1, 7]
    assert refs(mgr) == [1, 1, 0, 1, 1, 1, 0, 1]
    assert queue(mgr) == [6, 2]
    # E's third block re-registers the content C's evicted block 5 had.
    assert ids(mgr.get_computed_blocks(list(range(100, 114)))[0]) == [3, 4, 1]
    assert ids(mgr.get_computed_blocks(d.all_token_ids + [0])[0]) == [2, 6]

    for rid in ("E", "F"):
        mgr.free(rid)
    mgr.check_invariants()
    assert mgr.usage == 0 and mgr.num_free_blocks == 8


def test_lookup_stops_at_first_miss_even_if_later_blocks_are_cached():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prefill(mgr, Req("A", list(range(5))))  # block 0 registers the hash of tokens 0..3
    d = Req("D", list(range(9)))
    new = mgr.allocate_slots(d, 9)  # looked up before A was allocated: a duplicate block 0,
    mgr.check_invariants()          # then block 1 registered under the chain of the duplicate
    assert ids(new) == [2, 3, 4] and [b.block_hash is not None for b in new] == [False, True, False]
    mgr.free("A")
    prefill(mgr, Req("X", list(range(100, 120))))  # takes every free block, evicting block 0
    assert mgr.get_block_ids("X") == [1, 5, 6, 7, 0]
    # Block 3 (tokens 4..7 after 0..3) is still cached, but its parent is not: no hit at all.
    assert mgr.get_computed_blocks(list(range(10))) == ([], 0)


@pytest.mark.parametrize("prompt_len, expected_hits", [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2)])
def test_last_prompt_token_is_never_a_hit(prompt_len, expected_hits):
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(prompt_len))
    prefill(mgr, Req("warm", list(tokens)))
    assert len(mgr.block_pool.cached_blocks) == prompt_len // 4  # all full blocks are cached
    hits, num_tokens = mgr.get_computed_blocks(tokens)
    assert len(hits) == expected_hits and num_tokens == 4 * expected_hits
    hits, new = prefill(mgr, Req("again", list(tokens)))
    assert len(hits) == expected_hits and new is not None


def test_duplicate_content_computed_concurrently():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a, b = Req("A", list(range(9))), Req("B", list(range(9)))
    # Both look up before either is allocated (e.g. scheduled in the same step): both miss.
    hits_a, _ = mgr.get_computed_blocks(a.all_token_ids)
    hits_b, _ = mgr.get_computed_blocks(b.all_token_ids)
    assert hits_a == hits_b == []
    assert ids(mgr.allocate_slots(a, 9)) == [0, 1, 2]
    assert ids(mgr.allocate_slots(b, 9)) == [3, 4, 5]
    mgr.check_invariants()
    pool = mgr.block_pool
    assert [blk.block_hash is not None for blk in pool.blocks[:6]] == [True, True, False, False, False, False]
    assert len(pool.cached_blocks) == 2
    # B's duplicate can't be registered; re-registering returns False and changes nothing.
    hashes = hash_full_blocks(b.all_token_ids, 4)
    assert pool.cache_block(pool.blocks[3], hashes[0]) is False
    assert pool.get_cached_block(hashes[0]) is pool.blocks[0]

    # B keeps decoding past its duplicates: its next full block chains on the right hash.
    b.num_computed_tokens = 9
    for t in (9, 10, 11):
        assert decode(mgr, b, t) == []
    assert pool.blocks[5].block_hash == hash_full_blocks(b.all_token_ids, 4)[2]

    mgr.free("A")
    mgr.free("B")  # B's unhashed duplicates go to the head, reused first
    mgr.check_invariants()
    assert queue(mgr) == [3, 4, 2, 6, 7, 1, 0, 5]
    hits, _ = mgr.get_computed_blocks(list(range(12)) + [99])
    assert ids(hits) == [0, 1, 5]


def test_allocate_none_changes_nothing():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prefill(mgr, Req("A", list(range(10))))
    mgr.free("A")
    assert queue(mgr) == [2, 3, 4, 5, 6, 7, 1, 0]

    b = Req("B", list(range(8)) + [99])
    hits, n = mgr.get_computed_blocks(b.all_token_ids)
    assert ids(hits) == [0, 1] and n == 8
    before = snapshot(mgr, "B")
    # 8 + 25 tokens = 9 blocks: 7 new + 2 evictable hits > 8 free, although 7 <= 8.
    assert mgr.allocate_slots(b, 25, hits) is None
    assert snapshot(mgr, "B") == before
    assert mgr.get_blocks("B") == [] and refs(mgr) == [0] * 8
    mgr.check_invariants()
    # 6 new + 2 hits fits exactly.
    new = mgr.allocate_slots(b, 24, hits)
    assert ids(new) == [2, 3, 4, 5, 6, 7] and mgr.num_free_blocks == 0
    mgr.check_invariants()

    # A running request that can't grow is left untouched too.
    b.num_computed_tokens = 32
    before = snapshot(mgr, "B")
    assert mgr.allocate_slots(b, 1) is None
    assert snapshot(mgr, "B") == before
    assert mgr.allocate_slots(b, 0) == []  # fits in what it holds


def test_hit_blocks_held_by_others_cost_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    prefill(mgr, Req("A", list(range(9))))  # blocks 0,1,2 held
    b = Req("B", list(range(8)) + [50])
    hits, new = prefill(mgr, b)  # needs only 1 new block although 2 hits are shared
    assert ids(hits) == [0, 1] and ids(new) == [3]
    assert refs(mgr) == [2, 2, 1, 1]
    mgr.free("A")
    assert queue(mgr) == [2] and refs(mgr) == [1, 1, 0, 1]
    mgr.free("B")
    mgr.check_invariants()
    assert mgr.num_free_blocks == 4


def test_decode_tokens_filling_a_block_make_it_cacheable():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = Req("A", [5, 6, 7, 8, 9, 10])
    _, new = prefill(mgr, req)
    assert ids(new) == [0, 1]
    pool = mgr.block_pool
    assert pool.blocks[0].block_hash is not None and pool.blocks[1].block_hash is None

    assert decode(mgr, req, 11) == []  # 7 tokens: block 1 still partial
    assert pool.blocks[1].block_hash is None
    assert decode(mgr, req, 12) == []  # 8 tokens: block 1 full of known tokens
    expected = hash_full_blocks(req.all_token_ids, 4)
    assert pool.blocks[1].block_hash == expected[1]
    assert pool.get_cached_block(expected[1]) is pool.blocks[1]
    assert ids(decode(mgr, req, 13)) == [2]  # 9th token needs a new block

    mgr.free("A")
    hits, n = mgr.get_computed_blocks([5, 6, 7, 8, 9, 10, 11, 12, 0])
    assert ids(hits) == [0, 1] and n == 8


def test_lookahead_tokens_are_not_hashed():
    """Slots reserved beyond the known tokens are allocated but never hashed."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = Req("A", list(range(6)))
    new = mgr.allocate_slots(req, 10)  # room for 10 tokens, only 6 known
    assert ids(new) == [0, 1, 2]
    assert [b.block_hash is not None for b in new] == [True, False, False]
    mgr.check_invariants()


def test_chunked_prefill_hashes_incrementally():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = Req("A", list(range(14)), cache_salt="s")
    assert ids(mgr.allocate_slots(req, 5)) == [0, 1]
    req.num_computed_tokens = 5
    assert ids(mgr.allocate_slots(req, 5)) == [2]
    req.num_computed_tokens = 10
    assert ids(mgr.allocate_slots(req, 4)) == [3]
    req.num_computed_tokens = 14
    expected = hash_full_blocks(req.all_token_ids, 4, cache_salt="s")
    assert [b.block_hash for b in mgr.get_blocks("A")] == expected + [None]
    mgr.check_invariants()


def test_cache_salt_isolation():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    prefill(mgr, Req("A", list(tokens), cache_salt="tenant-a"))
    mgr.free("A")
    assert mgr.get_computed_blocks(tokens, "tenant-b") == ([], 0)
    assert mgr.get_computed_blocks(tokens, None) == ([], 0)
    hits, n = mgr.get_computed_blocks(tokens, "tenant-a")
    assert ids(hits) == [0, 1, 2] and n == 12
    hits, new = prefill(mgr, Req("B", list(tokens), cache_salt="tenant-b"))
    assert hits == [] and len(new) == 4
    hits, _ = prefill(mgr, Req("C", list(tokens), cache_salt="tenant-a"))
    assert ids(hits) == [0, 1, 2]


def test_reset_prefix_cache_only_when_nothing_is_held():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prefill(mgr, Req("A", list(range(9))))
    prefill(mgr, Req("B", list(range(100, 109))))
    mgr.free("A")
    assert mgr.reset_prefix_cache() is False
    assert len(mgr.get_computed_blocks(list(range(9)))[0]) == 2  # nothing dropped
    mgr.free("B")
    assert mgr.reset_prefix_cache() is True
    mgr.check_invariants()
    assert mgr.get_computed_blocks(list(range(9))) == ([], 0)
    assert mgr.block_pool.cached_blocks == {} and mgr.num_free_blocks == 8


def test_prefix_caching_disabled():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(mgr, Req("A", list(range(9))))
    mgr.free("A")
    assert mgr.get_computed_blocks(list(range(9))) == ([], 0)
    assert mgr.block_pool.cached_blocks == {}
    assert queue(mgr) == [0, 1, 2, 3, 4, 5, 6, 7]  # all unhashed: freed to the head in reverse
    mgr.check_invariants()


def test_preempted_request_recomputes_from_cache():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = Req("A", list(range(6)))
    prefill(mgr, req)
    for t in (6, 7, 8, 9):
        decode(mgr, req, t)
    assert mgr.get_block_ids("A") == [0, 1, 2]
    mgr.free("A")  # preempted: 10 known tokens, 2 full blocks cached
    req.num_computed_tokens = 0
    hits, new = prefill(mgr, req)
    assert ids(hits) == [0, 1] and ids(new) == [2]


def test_stale_hits_are_rejected_without_side_effects():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    prefill(mgr, Req("A", list(range(5))))
    mgr.free("A")
    hits, _ = mgr.get_computed_blocks(list(range(5)))
    assert ids(hits) == [0]
    prefill(mgr, Req("X", list(range(50, 62))))  # evicts block 0 and reuses it
    mgr.free("X")
    before = snapshot(mgr, "B")
    with pytest.raises(ValueError):
        mgr.allocate_slots(Req("B", list(range(5))), 1, hits)
    assert snapshot(mgr, "B") == before


def test_contract_violations():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError):  # num_computed_tokens must be set after allocate_slots
        mgr.allocate_slots(Req("A", list(range(8)), num_computed_tokens=4), 4)
    with pytest.raises(ValueError):
        mgr.allocate_slots(Req("A", [1]), -1)
    prefill(mgr, Req("A", list(range(9))))
    mgr.free("A")
    hits, _ = mgr.get_computed_blocks(list(range(9)))
    req = Req("B", [0, 1, 2])
    mgr.allocate_slots(req, 3)
    with pytest.raises(ValueError):  # hits only on a first allocation
        mgr.allocate_slots(req, 1, hits)
    mgr.free("nope")  # unknown id: no-op
    assert mgr.get_blocks("nope") == [] and mgr.get_block_ids("nope") == []
    mgr.check_invariants()


def test_check_invariants_detects_wrong_ref_count():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    prefill(mgr, Req("A", list(range(5))))
    mgr.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        mgr.check_invariants()
