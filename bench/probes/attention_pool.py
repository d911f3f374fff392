"""The native decode attention alone, over a pool the size of a real step's, and the read rate it
reaches (docs/benchmarks.md, "decode attention's memory bound").

``rows`` decode rows of ``context`` tokens each attend (``torch.ops.kvserve.paged_decode_attention``)
to their own blocks of ``layers`` separate K/V pools, one call per layer as a step makes them; before
each call a ``sweep_mib`` buffer is summed, standing in for the layer's weights that push the pool
out of cache (``--layers 1 --sweep-mib 0`` keeps one layer's pool in cache instead). A row's blocks
are contiguous for the first half of its context and interleaved with the other rows' after it, as
a prefill then lockstep decode allocate them. Reported per round of ``layers`` calls: the time and
the pool bytes over it.

    python -m bench.probes.attention_pool [--rows 16] [--context 400] [--layers 30] [--sweep-mib 3]
        [--kv-dtype float16] [--rounds 10] [--num-threads 2]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.machine import set_threads

# SmolLM2-135M's attention: 9 query heads, 3 kv heads of 64
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def block_tables(rows: int, blocks_per_row: int) -> torch.Tensor:
    """Each row's first half of blocks contiguous, the rest interleaved across rows."""
    tables = torch.empty(rows, blocks_per_row, dtype=torch.long)
    half, next_id = blocks_per_row // 2, 0
    for r in range(rows):
        tables[r, :half] = torch.arange(next_id, next_id + half)
        next_id += half
    for j in range(half, blocks_per_row):
        for r in range(rows):
            tables[r, j] = next_id
            next_id += 1
    return tables


def run_attention_pool(rows: int = 16, context: int = 400, layers: int = 30, sweep_mib: int = 3,
                       kv_dtype: torch.dtype = torch.float16, rounds: int = 10, block_size: int = 16) -> dict[str, Any]:
    """Time ``rounds`` rounds of ``layers`` attention calls (after one round of warm-up) and return
    the pool's bytes, the fastest and the median round (ms) and the bytes over the median (GB/s)."""
    from engine.kernels import load_kernels

    if not load_kernels():
        raise RuntimeError("the native kernels did not build here")
    blocks_per_row = -(-context // block_size)
    num_blocks = rows * blocks_per_row
    gen = torch.Generator().manual_seed(0)
    pools = [(torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype),
              torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype))
             for _ in range(layers)]
    tables = block_tables(rows, blocks_per_row)
    lens = torch.full((rows,), context, dtype=torch.long)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    sweep = torch.ones(sweep_mib * 2**18)
    attend = torch.ops.kvserve.paged_decode_attention
    times = []
    for _ in range(rounds + 1):  # the first round warms up
        total = 0.0
        for k_cache, v_cache in pools:
            if sweep_mib:
                sweep.sum()
            start = time.perf_counter()
            attend(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)
            total += time.perf_counter() - start
        times.append(total)
    times = sorted(times[1:])
    pool_bytes = 2 * layers * rows * context * KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    p50 = times[len(times) // 2]
    return {"rows": rows, "context": context, "layers": layers, "sweep_mib": sweep_mib, "kv_dtype": str(kv_dtype),
            "pool_bytes": pool_bytes, "min_ms": 1000 * times[0], "p50_ms": 1000 * p50,
            "read_gbs_p50": pool_bytes / p50 / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--sweep-mib", type=int, default=3)
    p.add_argument("--kv-dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.num_threads)
    r = run_attention_pool(args.rows, args.context, args.layers, args.sweep_mib, getattr(torch, args.kv_dtype),
                           args.rounds)
    print(f"{r['rows']} rows x {r['context']} tokens, {r['layers']} layers ({r['pool_bytes'] / 1e6:.0f} MB of "
          f"{args.kv_dtype} K/V): min {r['min_ms']:.2f} ms, p50 {r['p50_ms']:.2f} ms "
          f"a round, {r['read_gbs_p50']:.1f} GB/s at p50")


if __name__ == "__main__":
    main()
