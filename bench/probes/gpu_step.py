"""Where a decode step's time goes on the GPU: wall time against device time, per batch size.

    python -m bench.probes.gpu_step [--batches 1 64 256] [--prompt-len 512] [--tiny --device cpu]

Builds ``bench.gpu_check``'s engine (the Llama-3.1-8B shape, random bf16 weights, CUDA graphs;
``--tiny``: its tiny config), then for each batch size adds that many distinct prompts (batch 1
uses 100 tokens), steps until every row is in decode, times 20 steps, profiles 10 with
``torch.profiler`` (device time per kernel) and 10 with ``cProfile`` (host time per function),
and aborts the batch. Prints, per batch, the wall and device-busy ms per step and both tables.
The gap between the two is host work that does not overlap the GPU. Quoted in
docs/bench/gpu-h200.md.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import torch

from bench import gpu_check


def engine_args(device: str, tiny: bool) -> argparse.Namespace:
    """``bench.gpu_check``'s own flags for its engine, on ``device``, at 60% of the GPU's memory."""
    flags = ["--device", device, "--max-len", "1024", "--gpu-memory-utilization", "0.6"]
    return gpu_check.build_parser().parse_args(flags + (["--smoke"] if tiny else []))


def profile_batch(engine: Any, batch: int, prompt_len: int, device: str) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(batch):  # distinct first tokens: no prefix hits between rows
        engine.add_request([1 + (i * 7 + j) % 1000 for j in range(prompt_len)], gpu_check.sampling(400))
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    walls = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            engine.step()
        sync()
    host = cProfile.Profile()
    host.enable()
    for _ in range(10):
        engine.step()
    host.disable()
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 10
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(22)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return {"batch": batch, "wall_ms": statistics.median(walls) * 1e3, "device_ms": device_us / 1e3,
            "kernels": events.table(sort_by=sort, row_limit=14, max_name_column_width=60),
            "host": text.getvalue()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per row (batch 1: 100)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="bench.gpu_check's tiny config (anywhere, in seconds)")
    args = p.parse_args(argv)
    config = gpu_check.TINY if args.tiny else gpu_check.LLAMA_31_8B
    engine, start_s = gpu_check.build_engine(engine_args(args.device, args.tiny), config)
    print(f"engine {start_s:.2f} s; attention {engine.runner.model.attn.describe()}; "
          f"CUDA graphs {engine.runner.graphs is not None}")
    results = []
    for batch in args.batches:
        r = profile_batch(engine, batch, 100 if batch == 1 else args.prompt_len, args.device)
        print(f"=== batch {batch}: wall median {r['wall_ms']:.2f} ms/step, device busy {r['device_ms']:.2f} ms/step")
        print(r["kernels"])
        print(r["host"][-6000:])
        results.append(r)
    return results


if __name__ == "__main__":
    main()
