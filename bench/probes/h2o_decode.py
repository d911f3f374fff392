"""H2O decode speed (``--kv-eviction h2o``) per attention backend on the default model.

    python -m bench.probes.h2o_decode [--backends native torch] [--streams 4] [--prompt 256]
                                      [--tokens 128] [--budget 144] [--recent 48]

For each backend, one engine at the CPU defaults otherwise (``native``: the native decode path,
whose C++ kernels export the block mass; ``torch``: the Python layers through explicit softmax):
``--streams`` requests of ``--prompt`` tokens each generate ``--tokens`` greedy tokens under an
h2o budget they pass (so blocks are evicted while they decode). Prints decode tokens per second,
timed from the step after every prompt has been prefilled to the end, and the blocks evicted.
The engines run one after the other: on a shared machine compare them within one run.
"""
from __future__ import annotations

import argparse
import time

import torch

from cache import CacheConfig
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig


def decode_rate(args: argparse.Namespace, backend: str) -> tuple[float, int, str]:
    """(decode tokens per second, blocks evicted, the decode path) for one backend."""
    config = EngineConfig(model=ModelConfig(max_model_len=args.prompt + args.tokens + 16, attention_backend=backend),
                          cache=CacheConfig(kv_cache_memory_gib=0.25, kv_eviction="h2o", kv_budget_tokens=args.budget,
                                            kv_recent_tokens=args.recent),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=args.streams))
    engine = LLMEngine(config, load_model(None, torch.float32, False))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for s in range(args.streams):
        engine.add_request([(7 * j + 31 * s) % 20000 + 100 for j in range(args.prompt)], params)
    running = engine.scheduler.running
    while len(running) < args.streams or any(r.num_output_tokens == 0 for r in running):
        engine.step()  # prefill, until every stream has its first token
    start_tokens = sum(r.num_output_tokens for r in engine.scheduler.running)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    return ((args.streams * args.tokens - start_tokens) / elapsed, engine.kv_cache.num_evicted_blocks_total,
            engine.runner.model.decode_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["native", "torch"])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=144)
    p.add_argument("--recent", type=int, default=48)
    args = p.parse_args(argv)
    for backend in args.backends:
        rate, evicted, path = decode_rate(args, backend)
        print(f"{backend:>7} ({path} decode path): {rate:7.1f} decode tok/s, {evicted} blocks evicted")


if __name__ == "__main__":
    main()
