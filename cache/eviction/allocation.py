"""What eviction changes in one allocation of a request's blocks, planned before anything changes
(``KVCacheManager.allocate_slots`` checks the plan fits, then applies it) and the rebase's block
moves (copy on write of shared blocks, leaving the hash chain for re-rotated ones)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.block import KVBlock
from cache.block_pool import BlockPool, _check
from cache.eviction.base import EvictionPolicy, SequenceView
from cache.hashing import BlockHash


@dataclass
class AllocationPlan:
    sinks: int  # the request's sink blocks (0 when nothing is evicted)
    num_evict: int  # kept blocks to drop now
    indices: tuple[int, ...]  # their block-table indices (ascending; right after the sinks for streaming)
    rebase: bool
    dropped: list[KVBlock]
    num_evicted: int  # evicted blocks after this step
    num_new_blocks: int
    num_copies: int  # shared blocks a rebase copies (one free block each)
    num_freed: int  # held blocks the eviction returns to the free queue


def plan_allocation(policy: EvictionPolicy | None, evicts: bool, blocks: Sequence[KVBlock],
                    hits: Sequence[KVBlock], num_evicted_blocks: int, position_shift: int,
                    computed: int, num_new_tokens: int, block_size: int,
                    block_mass: Sequence[float] = ()) -> AllocationPlan:
    """The blocks one step needs: ``blocks`` held, ``hits`` taken now (first allocation only),
    ``computed`` text tokens before the step (hits included), ``num_new_tokens`` in it;
    ``block_mass`` the held blocks' accumulated attention mass (h2o; missing ones count 0)."""
    sinks, rebase, indices = 0, False, ()
    if policy is not None and evicts:
        mass = tuple(block_mass[:len(blocks)]) + (0.0,) * (len(blocks) + len(hits) - min(len(block_mass), len(blocks)))
        plan = policy.plan(SequenceView(computed, num_new_tokens, num_evicted_blocks, position_shift, mass))
        sinks, rebase = policy.sink_blocks, plan.rebase
        indices = tuple(plan.indices) if not policy.contiguous else tuple(range(sinks, sinks + plan.num_evict))
        if rebase and hits:
            raise ValueError("a rebase on a request's first allocation (hits are capped to avoid it)")
        if indices and (indices[0] < sinks or list(indices) != sorted(set(indices))
                        or indices[-1] >= len(blocks) + len(hits) - 1):
            raise ValueError(f"eviction plan {indices} drops a sink, the last block or one twice")
    kept = list(blocks) + list(hits)
    drop = set(indices)
    dropped = [kept[i] for i in indices]
    kept = [block for i, block in enumerate(kept) if i not in drop]
    num_evict = len(indices)
    num_evicted = num_evicted_blocks + num_evict
    num_required = -(-(computed + num_new_tokens - num_evicted * block_size) // block_size)
    return AllocationPlan(
        sinks, num_evict, indices, rebase, dropped, num_evicted, max(0, num_required - len(kept)),
        sum(1 for block in kept[sinks:] if block.ref_cnt > 1) if rebase else 0,
        # an evicted hit is touched and freed at once: it frees nothing
        sum(1 for block in dropped if block.ref_cnt == 1 and block not in hits))


def rebase_blocks(pool: BlockPool, blocks: list[KVBlock], sinks: int) -> tuple[list[tuple[int, int]], set[int]]:
    """Make ``blocks[sinks:]`` (in place) safe to re-rotate: a block another holder shares is
    replaced by a fresh copy (its ``(src, dst)`` returned, to copy before rotating); a block of
    the request's own leaves the prefix cache (its id returned), as its content no longer
    matches its hash."""
    copies: list[tuple[int, int]] = []
    uncached: set[int] = set()
    for j in range(sinks, len(blocks)):
        block = blocks[j]
        if block.ref_cnt > 1:
            (copy,) = pool.get_new_blocks(1)
            copies.append((block.block_id, copy.block_id))
            pool.free_blocks([block])
            blocks[j] = copy
        elif block.block_hash is not None:
            pool.uncache_block(block)
            uncached.add(block.block_id)
    return copies, uncached


def kept_text_indices(num_kept: int, evicted_text: Sequence[int]) -> list[int]:
    """The text block index of each of ``num_kept`` kept blocks, given the evicted text blocks."""
    gone = set(evicted_text)
    out: list[int] = []
    t = 0
    while len(out) < num_kept:
        if t not in gone:
            out.append(t)
        t += 1
    return out


def check_kept_blocks(request_id: str, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash], sinks: int,
                      num_evicted: int, position_shift: int, evicted_text: Sequence[int] | None = None) -> None:
    """AssertionError unless each kept block is uncached or cached under its own text block's
    hash (kept block j is text block j, or j + num_evicted past the sinks; or, given
    ``evicted_text``, the j-th text block not evicted), and no re-rotated block (past the sinks
    once a rebase happened) is cached at all."""
    texts = kept_text_indices(len(blocks), evicted_text) if evicted_text is not None else None
    if texts is not None:
        _check(len(evicted_text) == num_evicted, f"request {request_id!r}: evicted blocks miscounted")  # type: ignore[arg-type]
    for j, block in enumerate(blocks):
        text_index = texts[j] if texts is not None else (j if j < sinks else j + num_evicted)
        if text_index < len(hashes):
            _check(block.block_hash in (None, hashes[text_index]),
                   f"request {request_id!r}: block {block.block_id} is cached under a different hash")
        if position_shift and j >= sinks:
            _check(block.block_hash is None, f"request {request_id!r}: re-rotated block {block.block_id} is still cached")
