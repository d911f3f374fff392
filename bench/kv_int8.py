"""int8 KV quality: teacher-forced top-1 agreement and NLL against the model's own-dtype KV.

``teacher_forced(engine, tokens, chunk)`` runs ``tokens`` through an engine's model in prefill
chunks of ``chunk`` tokens (each chunk attends to the earlier ones through the paged pool, so
with int8 KV it reads dequantized blocks) and returns each position's log-probabilities of the
next token. ``compare`` gives the top-1 agreement and the mean NLL delta of two such runs.

    python -m bench.kv_int8 [--tokens 2000] [--chunk 256]   # the default model, fp32 vs int8 KV
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from scheduler.output import ScheduledRequest
from scheduler.request import Request


@torch.inference_mode()
def teacher_forced(engine: Any, tokens: list[int], chunk: int) -> torch.Tensor:
    """``[len(tokens) - 1, vocab]`` log-probabilities of the next token at each position."""
    request = Request("teacher-forced", list(tokens), SamplingParams(max_tokens=1), max_tokens=1)
    out = []
    try:
        while request.num_computed_tokens < len(tokens):
            n = min(chunk, len(tokens) - request.num_computed_tokens)
            if engine.kv_cache.allocate_slots(request, n) is None:
                raise ValueError("the KV pool cannot hold the text")
            item = ScheduledRequest(request, n, engine.kv_cache.get_block_ids(request.request_id))
            input_ids, positions, meta = engine.runner._prepare([item])
            hidden = engine.runner.model(input_ids, positions, meta, engine.runner.kv_caches)
            out.append(torch.log_softmax(engine.runner.model.compute_logits(hidden).float(), dim=-1))
            request.num_computed_tokens += n
    finally:
        engine.kv_cache.free(request.request_id)
    return torch.cat(out)[:-1]


def compare(reference: torch.Tensor, other: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    target = torch.tensor(tokens[1:])
    agree = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    nll_ref = -reference.gather(1, target[:, None]).mean().item()
    nll_other = -other.gather(1, target[:, None]).mean().item()
    return {"top1_agreement": agree, "nll_reference": nll_ref, "nll_int8": nll_other,
            "nll_delta": nll_other - nll_ref}


def main() -> None:
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    text = open(__file__.replace("kv_int8.py", "common.py")).read() * 4  # a fixed text (this repo's code)
    results = {}
    for kv in ("auto", "int8"):
        engine = LLMEngine(EngineConfig(model=ModelConfig(num_threads=args.num_threads, max_model_len=4096,
                                                          attention_backend="torch"),
                                        cache=CacheConfig(num_blocks=(args.tokens + 64) // 16 + 1, kv_cache_dtype=kv)),
                           load_model(None, torch.float32))
        tokens = engine.tokenizer(text)["input_ids"][:args.tokens]
        t0 = time.perf_counter()
        results[kv] = teacher_forced(engine, tokens, args.chunk)
        print(f"{kv}: {time.perf_counter() - t0:.1f} s, capacity {engine.capacity.bytes_per_token} bytes/token")
    print(compare(results["auto"], results["int8"], tokens))


if __name__ == "__main__":
    main()
