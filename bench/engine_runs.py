"""kvserve's engine in this process, timed the way the in-process peers are.

* ``load_engine``: a model (the default, or a GGUF or checkpoint path) as an ``LLMEngine``;
* ``load_default_pair``: the default model as an ``LLMEngine`` and (optionally) its
  transformers twin on the same dense weights;
* ``kvserve_single``: one request stepped by hand (TTFT, then the decode after the first token);
* ``kvserve_batch``: one ``generate`` call over many prompts (continuous batching);
* ``run_kvserve``: a request list through ``InprocEngineClient``, all submitted at once;
* ``weight_bytes_per_decode_token``: the weight bytes one decode step streams.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from bench.machine import set_threads
from bench.peers.transformers import load_model
from bench.workload import BenchRequest
from kvtypes.sampling_params import SamplingParams


def load_engine(model: str | None = None, num_threads: int | None = None, max_model_len: int = 2048,
                kv_cache_gib: float = 1.0, max_num_seqs: int = 64, max_num_batched_tokens: int = 512) -> Any:
    """kvserve's LLMEngine on ``model`` (None: the default model; else a GGUF file or checkpoint
    folder) at the CPU defaults, with the bench's pool and batch sizes."""
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    threads = set_threads(num_threads)
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, num_threads=threads, max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_memory_gib=kv_cache_gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)))


def load_default_pair(num_threads: int | None = None, max_model_len: int = 2048, kv_cache_gib: float = 1.0,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 512, with_hf: bool = True):
    """kvserve's LLMEngine and transformers' model on the same dense weights of the default model."""
    engine = load_engine(None, num_threads, max_model_len, kv_cache_gib, max_num_seqs, max_num_batched_tokens)
    if not with_hf:
        return engine, None
    return engine, load_model()


def weight_bytes_per_decode_token(engine: Any) -> int:
    """Bytes of weights one kvserve decode step streams with its kernels in use: every
    layer's matrices and norms, the final norm and the LM head (the embedding lookup reads
    one row and is not counted); GGUF blocks where the decode matmuls read blocks."""
    return engine.runner.model.decode_weight_bytes()


def _params(n: int) -> SamplingParams:
    # min_tokens masks EOS (and only EOS) until n tokens exist, as HF's min_new_tokens does.
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


def kvserve_single(engine: Any, prompt: Sequence[int], new_tokens: int,
                   params: SamplingParams | None = None) -> dict[str, Any]:
    """One request through ``engine.step()``; times the first token and the decode after it.
    ``params`` defaults to greedy with EOS masked until ``new_tokens`` (as HF's min_new_tokens)."""
    engine.add_request(list(prompt), params or _params(new_tokens))
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if first is None and tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": tokens, "ttft_s": first - start, "decode_s": end - first}


def kvserve_batch(engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    results = engine.generate([list(p) for p in prompts], _params(new_tokens))
    elapsed = time.perf_counter() - start
    return {"tokens": [r.token_ids for r in results], "elapsed_s": elapsed,
            "cached_prompt_tokens": sum(r.num_cached_tokens for r in results)}


def run_kvserve(engine: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """All requests through the in-process engine client at once; returns elapsed time, tokens and TTFTs."""
    from engine.core.client import InprocEngineClient

    async_engine = InprocEngineClient(engine)
    async_engine.start()
    try:
        return asyncio.run(_kvserve_requests(async_engine, requests))
    finally:
        async_engine.shutdown()


async def _kvserve_requests(async_engine: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    async def one(req: BenchRequest) -> tuple[int, float, str | None]:
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        sent = time.perf_counter()
        first = None
        count = 0
        error = None
        async for out in async_engine.generate(req.prompt_token_ids, params):
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            count += len(out.new_token_ids)
            error = out.error or error
        return count, (first or time.perf_counter()) - sent, error

    start = time.perf_counter()
    done = await asyncio.gather(*(one(r) for r in requests))
    elapsed = time.perf_counter() - start
    errors = [e for _, _, e in done if e]
    if errors:
        raise RuntimeError(f"kvserve request failed: {errors[0]}")
    ttfts = sorted(t for _, t, _ in done)
    return {"elapsed_s": elapsed, "output_tokens": sum(c for c, _, _ in done),
            "ttft_median_s": ttfts[len(ttfts) // 2], "steps": async_engine.num_steps}
