"""Scenario ``kv-tier``: TTFT of a long prefix restored from the disk tier versus a miss.

In-process ``LLMEngine``s with a disk tier in a temporary folder and a device pool that holds
one request of the prompt length but not two. Each round runs, one request at a time:

* a *miss*: a prompt of the same length under a fresh ``cache_salt`` (nothing shared); its
  blocks evict the shared prefix from the device pool, and the eviction writes it to disk;
* an *evicted-then-restored hit*: the shared prefix + a new short suffix; its prefix blocks
  come back from the disk tier (the tier is flushed first, so they are read from files).

Then the engine is closed and a new one opens the same folder (a *restart*): its first request
on the shared prefix is restored from disk too, and one more miss is timed next to it.
TTFT = time from ``add_request`` to the first sampled token, stepping the engine. Target: a hit
at least 5x faster than a miss, in both cases.
"""
from __future__ import annotations

import random
import tempfile
import time
from typing import Any, Callable

from bench.machine import machine_info
from bench.report import Progress, check, info, median, table
from kvtypes.sampling_params import SamplingParams

TARGET = 5.0


def _ttft(engine: Any, prompt: list[int], salt: str | None) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of one request run alone, to completion."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params, cache_salt=salt)
    first = None
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                first = time.perf_counter() - t0
                cached = out.num_cached_tokens
    assert first is not None
    return first, cached


def build_engine(folder: str, prompt_tokens: int, block_size: int = 16, num_threads: int | None = None,
                 loaded: Any = None, tensor_parallel_size: int = 1) -> Any:
    """The default model with a disk tier in ``folder`` and a pool of one prompt (+ slack);
    ``tensor_parallel_size`` > 1 splits it over ranks (the tier copies gather every rank's heads)."""
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    num_blocks = -(-(prompt_tokens + 64) // block_size)
    return LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=num_threads, max_model_len=num_blocks * block_size,
                          tensor_parallel_size=tensor_parallel_size),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_disk_dir=folder, kv_disk_gib=2.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=512)), loaded)


def run_kv_tier(make_engine: Callable[[str], Any], vocab_size: int, prefix_tokens: int = 2000, suffix_tokens: int = 16,
                rounds: int = 3, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab_size - 10) for _ in range(n)]

    prefix = tokens(prefix_tokens)
    misses: list[tuple[float, int]] = []
    evicted_hits: list[tuple[float, int]] = []
    restart_hits: list[tuple[float, int]] = []
    restart_misses: list[tuple[float, int]] = []
    disk_tokens = 0
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-tier-") as folder, \
            Progress(2 * rounds + 3, "kv-tier", progress) as bar:
        engine = make_engine(folder)
        _ttft(engine, prefix + tokens(suffix_tokens), None)  # fills the device pool (untimed)
        bar.update(1)
        for i in range(rounds):
            misses.append(_ttft(engine, tokens(prefix_tokens + suffix_tokens), f"bench-miss-{seed}-{i}"))
            bar.update(1)
            engine.offloader.tier.flush(60)
            before = engine.scheduler.stats.tier_hits["disk"]
            evicted_hits.append(_ttft(engine, prefix + tokens(suffix_tokens), None))
            disk_tokens += engine.scheduler.stats.tier_hits["disk"] - before
            bar.update(1)
        # Leave the prefix on disk only (a miss evicts it), then restart on the same folder.
        _ttft(engine, tokens(prefix_tokens + suffix_tokens), "bench-evict")
        engine.close()
        del engine
        bar.update(1)
        engine = make_engine(folder)
        restart_hits.append(_ttft(engine, prefix + tokens(suffix_tokens), None))
        restart_misses.append(_ttft(engine, tokens(prefix_tokens + suffix_tokens), "bench-miss-restart"))
        engine.close()
        bar.update(1)

    def ms(pairs: list[tuple[float, int]]) -> list[float]:
        return [round(1000 * t, 1) for t, _ in pairs]

    miss_med = median(ms(misses) + ms(restart_misses))
    evicted_med, restart_med = median(ms(evicted_hits)), median(ms(restart_hits))
    ratio_evicted = round(miss_med / evicted_med, 2) if miss_med and evicted_med else None
    ratio_restart = round(miss_med / restart_med, 2) if miss_med and restart_med else None
    rows = [["miss (fresh salt)", len(misses) + len(restart_misses), 0, miss_med],
            ["hit, evicted then restored from disk", len(evicted_hits), median([c for _, c in evicted_hits]),
             evicted_med],
            ["hit, restored from disk after a restart", len(restart_hits), restart_hits[0][1], restart_med]]
    result: dict[str, Any] = {
        "scenario": "kv-tier", "title": "Disk tier: TTFT of a restored prefix vs a miss",
        "workload": {"prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens, "rounds": rounds},
        "miss_ms": ms(misses) + ms(restart_misses), "evicted_hit_ms": ms(evicted_hits),
        "restart_hit_ms": ms(restart_hits),
        "cached_tokens": {"evicted": [c for _, c in evicted_hits], "restart": [c for _, c in restart_hits]},
        "disk_hit_tokens_evicted": disk_tokens,
        "notes": [f"A {prefix_tokens}-token prefix + {suffix_tokens} fresh tokens, 2 output tokens, one request at "
                  "a time, in process. The device pool holds one such request, so each miss evicts the prefix "
                  "(written to disk by the tier's writer thread); the tier is flushed before each hit, so the hit "
                  "reads files (from the OS page cache when warm)."],
        "tables": [table("kv-tier: TTFT (ms)", ["request", "count", "cached tokens (median)", "TTFT p50"], rows)],
    }
    result["checks"] = [
        check("disk-tier hit (evicted, restored) TTFT lower than a miss", ratio_evicted, TARGET,
              detail=f"miss p50 {miss_med} ms, hit p50 {evicted_med} ms"),
        check("disk-tier hit after a restart TTFT lower than a miss", ratio_restart, TARGET,
              detail=f"miss p50 {miss_med} ms, hit {restart_med} ms"),
        info("prefix tokens restored from disk per evicted hit", disk_tokens // max(1, rounds)),
    ]
    result["machine"] = machine_info()
    return result
