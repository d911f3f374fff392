"""Scenario ``roofline``: this machine's limits, measured in the same run, and kvserve against them.

* compute bound: fp32 matmul GFLOP/s (``n x n @ n x n``, best of ``repeats``, the current
  torch thread count);
* bandwidth bound: read bandwidth of a ``sum`` over a buffer far larger than the caches
  (``bench.machine.memory_bandwidth_gbs``);
* kvserve's single-stream decode (engine, in process) against the bandwidth bound: every
  decode token streams all weights once (``weight_bytes_per_decode_token``: the GGUF blocks
  where the decode matmuls read them, fp32 elsewhere), so the bound is bandwidth / weight
  bytes tokens/s; target at least 80% of it;
* kvserve's peak throughput (``batch`` prompts generated together) against the compute bound:
  a token costs 2 FLOPs per weight (attention ignored), so the bound is GFLOP/s / (2 x
  weights) tokens/s.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.engine_runs import kvserve_batch, kvserve_single, weight_bytes_per_decode_token
from bench.machine import machine_info, memory_bandwidth_gbs
from bench.report import check, info, new_figure, save_figure, table

BANDWIDTH_TARGET = 0.8


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def run_roofline(engine: Any, single_prompts: Sequence[Sequence[int]], batch_prompts: Sequence[Sequence[int]],
                 new_tokens: int = 32, matmul_n: int = 2048, bandwidth_mib: int = 1024, repeats: int = 5,
                 out_dir: Path | None = None) -> dict[str, Any]:
    first_gflops = matmul_gflops(matmul_n, repeats)
    first_bandwidth = memory_bandwidth_gbs(bandwidth_mib, repeats)
    weight_bytes = weight_bytes_per_decode_token(engine)
    model = engine.runner.model
    flops_per_token = 2 * (sum(p.numel() for p in model.layers.parameters()) + model.norm.numel()
                           + model.lm_head.numel())

    kvserve_single(engine, single_prompts[0], 4)  # warm-up
    engine.kv_cache.reset_prefix_cache()
    runs = [kvserve_single(engine, p, new_tokens) for p in single_prompts]
    single_tps = sum(len(r["tokens"]) - 1 for r in runs) / sum(r["decode_s"] for r in runs)
    engine.kv_cache.reset_prefix_cache()
    batch = kvserve_batch(engine, batch_prompts, new_tokens)
    engine.kv_cache.reset_prefix_cache()
    batch_tps = len(batch_prompts) * new_tokens / batch["elapsed_s"]
    # Measured again after the model ran; the bound is the better of the two (it is what the
    # machine can do; the worse one only says how much a neighbour took at that moment).
    bandwidth_after = memory_bandwidth_gbs(bandwidth_mib, repeats)
    gflops_after = matmul_gflops(matmul_n, repeats)
    gflops, bandwidth = max(first_gflops, gflops_after), max(first_bandwidth, bandwidth_after)
    bw_bound = bandwidth * 1e9 / weight_bytes
    compute_bound = gflops * 1e9 / flops_per_token

    bw_fraction = single_tps / bw_bound
    compute_fraction = batch_tps / compute_bound
    result: dict[str, Any] = {
        "scenario": "roofline", "title": "Roofline: kvserve against this machine's bounds",
        "machine_bounds": {"matmul_gflops": round(gflops, 2), "matmul_gflops_runs": [round(first_gflops, 2),
                                                                                     round(gflops_after, 2)],
                           "bandwidth_gbs": round(bandwidth, 2), "bandwidth_gbs_runs": [round(first_bandwidth, 2),
                                                                                       round(bandwidth_after, 2)],
                           "matmul_n": matmul_n, "bandwidth_mib": bandwidth_mib},
        "model": {"weight_bytes_per_token": weight_bytes, "flops_per_token": flops_per_token},
        "bandwidth_bound_tps": round(bw_bound, 2), "compute_bound_tps": round(compute_bound, 2),
        "kvserve_single_decode_tps": round(single_tps, 3), "kvserve_batch_tps": round(batch_tps, 3),
        "batch_size": len(batch_prompts), "new_tokens": new_tokens,
        "bandwidth_fraction": round(bw_fraction, 4), "compute_fraction": round(compute_fraction, 4),
        "achieved_gbs_single": round(single_tps * weight_bytes / 1e9, 2),
        "achieved_gflops_batch": round(batch_tps * flops_per_token / 1e9, 2),
        "notes": [f"fp32 matmul {matmul_n}^3 and a {bandwidth_mib} MiB sum, best of {repeats}, measured before and "
                  f"after the model ran (the better one is the bound); {weight_bytes / 1e6:.0f} MB of weights "
                  "streamed per decode token, "
                  f"{flops_per_token / 1e9:.2f} GFLOP per token. Single stream: {len(single_prompts)} prompts x "
                  f"{new_tokens} tokens (decode only); peak: {len(batch_prompts)} prompts x {new_tokens} tokens "
                  "together (prefill included), engine in process."],
    }
    result["tables"] = [table("roofline", ["measure", "machine bound", "kvserve", "fraction"], [
        ["memory bandwidth GB/s (sum)", round(bandwidth, 2), result["achieved_gbs_single"], round(bw_fraction, 3)],
        ["single-stream decode tokens/s", round(bw_bound, 2), round(single_tps, 2), round(bw_fraction, 3)],
        ["fp32 matmul GFLOP/s", round(gflops, 2), result["achieved_gflops_batch"], round(compute_fraction, 3)],
        [f"peak throughput tokens/s (batch {len(batch_prompts)})", round(compute_bound, 2), round(batch_tps, 2),
         round(compute_fraction, 3)],
    ])]
    result["checks"] = [
        check("single-stream decode / memory-bandwidth bound", bw_fraction, BANDWIDTH_TARGET, unit="",
              detail=f"{single_tps:.1f} of {bw_bound:.1f} tok/s at {bandwidth:.1f} GB/s "
                     f"(runs: {first_bandwidth:.1f}, {bandwidth_after:.1f})"),
        info("peak throughput / compute bound", round(compute_fraction, 3),
             f"{batch_tps:.1f} of {compute_bound:.1f} tok/s at {gflops:.1f} GFLOP/s (runs: {first_gflops:.1f}, "
             f"{gflops_after:.1f})"),
    ]
    result["plots"] = _plot(result, out_dir) if out_dir else []
    result["machine"] = machine_info()
    return result


def _plot(r: dict[str, Any], out_dir: Path) -> list[str]:
    fig, ax = new_figure(1, 5.2, 3.8)
    if fig is None:
        return []
    peak, bw = r["machine_bounds"]["matmul_gflops"], r["machine_bounds"]["bandwidth_gbs"]
    intensities = [2 ** (i / 4) for i in range(-12, 41)]  # FLOP per byte
    ax.plot(intensities, [min(peak, bw * x) for x in intensities], "-", color="#333", label="roofline")
    fpt, wb = r["model"]["flops_per_token"], r["model"]["weight_bytes_per_token"]
    single_ai = fpt / wb
    batch_ai = single_ai * r["batch_size"]
    ax.plot([single_ai], [r["kvserve_single_decode_tps"] * fpt / 1e9], "o", color="#2a7", label="kvserve batch 1")
    ax.plot([batch_ai], [r["kvserve_batch_tps"] * fpt / 1e9], "s", color="#36c",
            label=f"kvserve batch {r['batch_size']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / weight byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("fp32 roofline (measured)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return [save_figure(fig, out_dir / "roofline.png")]
