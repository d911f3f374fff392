"""Tier payloads of a head-split pool (engine/parallel/block_copy.py) equal the single-rank
``BlockCopier`` payloads byte for byte, for float and int8 pools, and write back per rank."""
from __future__ import annotations

import pytest
import torch

from engine.kv.int8 import Int8KV, quantize
from engine.kv.transfer import BlockCopier
from engine.parallel.block_copy import (assemble, full_block_bytes, local_bytes, pool_tensors, read_local,
                                       split_payloads, write_local)

WORLD, LAYERS, BLOCKS, BS, HEADS, D = 2, 2, 6, 4, 4, 8


def full_pool(int8: bool) -> list:
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            x = torch.randn(BLOCKS, BS, HEADS, D, generator=g)
            pair.append(Int8KV(*quantize(x)) if int8 else x)
        pairs.append(tuple(pair))
    return pairs


def rank_slice(pool: list, rank: int) -> list:
    h = HEADS // WORLD
    heads = slice(rank * h, (rank + 1) * h)

    def cut(c):
        if isinstance(c, Int8KV):
            return Int8KV(c.data[:, :, heads].contiguous(), c.scale[:, :, heads].contiguous())
        return c[:, :, heads].contiguous()

    return [tuple(cut(c) for c in pair) for pair in pool]


@pytest.mark.parametrize("int8", [False, True])
def test_gathered_payloads_equal_the_single_rank_layout(int8):
    pool = full_pool(int8)
    ranks = [rank_slice(pool, r) for r in range(WORLD)]
    single = BlockCopier(pool)
    ids = [4, 1, 3]
    tensors = pool_tensors(ranks[0])
    assert sum(full_block_bytes(tensors, WORLD)) == single.payload_bytes
    payloads = assemble([read_local(pool_tensors(r), ids) for r in ranks], tensors, len(ids))
    assert payloads == [single.read_block(i) for i in ids]
    # Split by heads and written back into empty rank pools at other block ids.
    chunks = split_payloads(payloads, tensors, WORLD)
    assert [c.numel() for c in chunks] == [local_bytes(tensors, len(ids))] * WORLD
    empty = [rank_slice(full_pool(int8), r) for r in range(WORLD)]
    for r, rank_pool in enumerate(empty):
        for t in pool_tensors(rank_pool):
            t.zero_()
        write_local(pool_tensors(rank_pool), [0, 2, 5], chunks[r])
        for got, want in zip(pool_tensors(rank_pool), pool_tensors(ranks[r])):
            assert torch.equal(got[[0, 2, 5]], want[ids])
            assert not got[[1, 3, 4]].any()
