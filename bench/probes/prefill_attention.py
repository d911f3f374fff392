"""A prefill chunk's attention alone: kvserve's kernel for the dtype it attends in (bf16: the AMX-BF16
``prefill_attention``; fp32: the AVX2 ``prefill_attention_f32``) against the torch path it replaces
on the ``native`` backend (``attend_after_prefix``: two flash calls and a log-sum-exp merge), on
the same inputs, alternated in one process (docs/benchmarks.md, "prefill attention on the AMX
tiles" and "prefill attention in AVX2 vectors"). Shapes: SmolLM2's heads (9 of 64 over 3 KV
heads), ``queries`` new tokens after ``prefix`` cached ones, keys and values fp16 as the CPU pool
holds them.

    python -m bench.probes.prefill_attention [--shapes 512:0 488:512 512:3488 512:7488] [--rounds 20]
        [--num-threads 2] [--dtype bfloat16|float32]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.machine import set_threads

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention


def _quartile_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 4]


def run_prefill_attention(queries: int, prefix: int, rounds: int = 20, dtype: str = "bfloat16") -> dict[str, Any]:
    """The lower-quartile time (ms) of each path over ``rounds`` calls, alternated in blocks of 5,
    and the two outputs' largest difference, for chunks attending in ``dtype``."""
    from engine.attention.native import PREFILL_KERNELS, native_prefill_runs
    from engine.attention.torch_sdpa import attend_after_prefix

    chunk_dtype = getattr(torch, dtype)
    kernel = PREFILL_KERNELS[chunk_dtype]
    if not native_prefill_runs(HEAD_DIM, chunk_dtype):
        raise RuntimeError(f"{kernel.name} does not run on this CPU (it needs {kernel.needs})")
    op = getattr(torch.ops.kvserve, kernel.op)
    gen = torch.Generator().manual_seed(queries + prefix)
    q = torch.randn(queries, HEADS, HEAD_DIM, generator=gen)
    keys = torch.randn(prefix + queries, KV_HEADS, HEAD_DIM, generator=gen).half()
    values = torch.randn(prefix + queries, KV_HEADS, HEAD_DIM, generator=gen).half()

    def ours() -> torch.Tensor:
        return op(q, keys, values, prefix, HEAD_DIM ** -0.5)

    def torch_path() -> torch.Tensor:  # as TorchAttention._prefill calls it on the CPU
        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(0, 1).unsqueeze(0).to(chunk_dtype)
        out = attend_after_prefix(heads_first(q), heads_first(keys), heads_first(values), prefix)
        return out[0].transpose(0, 1).float()

    diff = (ours() - torch_path()).abs().max().item()
    ours_ms, torch_ms = [], []
    for _ in range(max(1, rounds // 5)):
        ours_ms.append(_quartile_ms(ours, 5))
        torch_ms.append(_quartile_ms(torch_path, 5))
    return {"dtype": dtype, "queries": queries, "prefix": prefix, "kvserve_ms": round(min(ours_ms), 3),
            "torch_ms": round(min(torch_ms), 3), "speedup": round(min(torch_ms) / min(ours_ms), 2),
            "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["512:0", "488:512", "512:3488", "512:7488"],
                        help="queries:prefix pairs")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype the chunk attends in (which kernel)")
    args = parser.parse_args()
    set_threads(args.num_threads)
    for shape in args.shapes:
        queries, prefix = (int(x) for x in shape.split(":"))
        print(run_prefill_attention(queries, prefix, args.rounds, args.dtype))


if __name__ == "__main__":
    main()
