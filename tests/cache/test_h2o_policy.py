"""H2OPolicy at block granularity: over budget, the kept blocks with the least accumulated
attention mass leave, never a sink, a recent block or the open one; the manager takes them out
of the block table (holes in the text, not in the table) and back to the pool."""
from dataclasses import dataclass

from cache.eviction import EvictionConfig, SequenceView, build_policy
from cache.kv_cache_manager import KVCacheManager


def policy(budget, recent, sinks=4, bs=4):
    return build_policy(EvictionConfig("h2o", sinks, block_size=bs, budget_tokens=budget,
                                       recent_tokens=recent).resolve(1024, 16))


def test_within_budget_nothing_leaves():
    p = policy(budget=32, recent=8)  # 8 blocks
    assert p.plan(SequenceView(32, 1, 0, 0, (1.0,) * 8)).num_evict == 0


def test_the_lightest_non_protected_blocks_leave():
    p = policy(budget=24, recent=8)  # 6 blocks; sink block 0; recent tokens 32..39 in kept 8, 9
    mass = (100, 5, 1, 7, 0.5, 9, 3, 8, 0, 0)
    plan = p.plan(SequenceView(40, 1, 0, 0, mass))
    assert plan.indices == (1, 2, 4, 6) and plan.num_evict == 4  # ascending; blocks 8, 9 recent
    assert not plan.rebase


def test_ties_go_to_the_oldest_and_recent_blocks_stay_even_without_mass():
    p = policy(budget=16, recent=4, sinks=0)  # 4 blocks
    plan = p.plan(SequenceView(22, 1, 0, 0, ()))  # 6 kept blocks (the last one open), no mass yet
    assert plan.indices == (0, 1)  # recent tokens 18..21 sit in kept blocks 4 and 5


@dataclass
class Req:
    request_id: str
    all_token_ids: list
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    evicts: bool = True


def test_the_manager_drops_the_chosen_blocks_keeps_the_slot_rule_and_counts_them():
    mgr = KVCacheManager(32, 4, eviction=policy(budget=16, recent=4, sinks=4))
    req = Req("a", list(range(24)))
    mgr.allocate_slots(req, 24)
    req.num_computed_tokens = 24
    ids = mgr.get_block_ids("a")
    mgr.add_block_mass("a", [50, 1, 9, 0.5, 7, 2])
    req.all_token_ids.append(24)
    mgr.allocate_slots(req, 1)
    kept = mgr.get_block_ids("a")
    # 6 blocks + the new token's would-be block 7 over a 4-block budget: blocks 1 and 3 (mass 1, 0.5)
    assert kept[:4] == [ids[0], ids[2], ids[4], ids[5]] and len(kept) == 5
    assert mgr.block_mass("a")[:4] == [50, 9, 7, 2]
    assert mgr.sequence_offsets("a") == (8, 0)  # the new token goes to slot 24 - 8 = 16: kept block 4
    assert mgr.num_evicted_blocks_total == 2
    mgr.check_invariants()
    # the evicted blocks keep their hashes: a new request with the same prompt hits all of them
    hits, n = mgr.get_computed_blocks(list(range(24)) + [99])
    assert [b.block_id for b in hits] == ids and n == 24
