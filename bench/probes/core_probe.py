"""Single-stream decode through the engine client alone, no HTTP: the core in its own process
against the core in a thread, side by side.

    python -m bench.probes.core_probe [--rounds 3] [--tokens 128] [--num-threads 2]

``bench.probes.engine_modes`` compares the two modes through the whole server. This probe removes the
HTTP side (uvicorn, SSE, the benchmark client) so that a gap between the modes is attributed:
if the core process is slower here too, the cost is in the core process or its pipe; if not,
it is in the frontend. Each round builds one client per mode (order alternating), sends one
warm-up request, then ``--requests`` greedy requests of ``--tokens`` tokens on a ~50-token
prompt, one at a time, and records when each output reaches the caller. It prints the mean
inter-token interval and the time to the first token per mode, and the process/thread ratio
of decode tokens/s.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

PROMPT = ("You are a careful assistant. Summarise in two sentences why a paged key-value cache lets an "
          "inference server batch requests of different lengths without copying memory.")


def build_client(mode: str, config: Any) -> Any:
    from engine.core.client import InprocEngineClient
    from engine.core.process_client import MPEngineClient

    if mode == "process":
        import torch

        torch.set_num_threads(1)  # as kvserve.compose does for the frontend
        client = MPEngineClient(config)
    else:
        from engine.llm_engine import LLMEngine

        client = InprocEngineClient(LLMEngine(config))
    client.start()
    return client


async def one_request(client: Any, prompt_ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, the intervals between later outputs in seconds)."""
    from kvtypes.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    stamps: list[float] = []
    async for out in client.generate(prompt_ids, params):
        stamps += [time.perf_counter()] * len(out.new_token_ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps


def run_mode(mode: str, config: Any, args: argparse.Namespace) -> dict[str, float]:
    client = build_client(mode, config)
    try:
        prompt_ids = client.tokenizer.encode(PROMPT)

        async def main() -> list[tuple[float, list[float]]]:
            await one_request(client, prompt_ids, 8)  # warm-up
            return [await one_request(client, prompt_ids, args.tokens) for _ in range(args.requests)]

        results = asyncio.run(main())
    finally:
        client.shutdown()
    gaps = [g for _, gs in results for g in gs]
    return {"itl_ms": 1000 * statistics.fmean(gaps), "ttft_ms": 1000 * statistics.median(t for t, _ in results),
            "prompt_tokens": len(prompt_ids)}


def main(argv: list[str] | None = None) -> int:
    from kvserve.cli import add_engine_args, build_engine_config

    p = argparse.ArgumentParser(prog="python -m bench.probes.core_probe", description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.num_threads is None:
        args.num_threads = 2
    config, _ = build_engine_config(args)
    rows: dict[str, list[dict[str, float]]] = {"process": [], "thread": []}
    for r in range(args.rounds):
        for mode in (("process", "thread") if r % 2 == 0 else ("thread", "process")):
            row = run_mode(mode, config, args)
            rows[mode].append(row)
            print(f"round {r} {mode:>8}: inter-token {row['itl_ms']:.2f} ms, first token {row['ttft_ms']:.1f} ms",
                  flush=True)
    itl = {m: statistics.median(x["itl_ms"] for x in rows[m]) for m in rows}
    ttft = {m: statistics.median(x["ttft_ms"] for x in rows[m]) for m in rows}
    print(f"median over {args.rounds} rounds ({rows['process'][0]['prompt_tokens']:.0f}-token prompt, "
          f"{args.tokens} tokens, {args.num_threads} threads):")
    for m in rows:
        print(f"  {m:>8}: inter-token {itl[m]:.2f} ms ({1000 / itl[m]:.1f} tok/s), first token {ttft[m]:.1f} ms")
    print(f"  process/thread decode tok/s: {itl['thread'] / itl['process']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
