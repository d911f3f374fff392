"""StreamingLLM eviction (``--kv-eviction streaming``): the quality table's row against dense KV.

    python -m bench.probes.kv_eviction [--tokens 1000] [--window 128] [--sinks 4] [--chunk 64]
                                       [--context 1024] [--score-from 384]

Teacher-forces the first ``--tokens`` tokens of CPython's ``pydoc_data.topics`` (prompt logprobs,
prefill chunks of ``--chunk`` tokens, as the issue's transformers reference evicts 64 at a time)
through three engines on the default model: dense KV, sinks + window, window only (0 sinks).
Prints, per policy, the mean NLL (nats/token) on positions ``--score-from`` on and its delta to
dense, the teacher-forced top-1 agreement with dense, and the KV bytes held per token of text at
the end (pool bytes per token x tokens held / tokens seen). One run, machine load hits the three
engines alike (they run one after the other, so compare the quality columns, not times).
"""
from __future__ import annotations

import argparse

import torch

from cache import CacheConfig
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig


def text_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    return tokenizer("\n".join(topics[k] for k in sorted(topics)))["input_ids"][:n]


def run(args: argparse.Namespace, policy: str, sinks: int, ids: list[int] | None = None):
    """(per-position (logprob, top-1 id) from position 1 on, tokens held at the end, bytes per token, ids)."""
    config = EngineConfig(model=ModelConfig(max_model_len=args.context),
                          cache=CacheConfig(kv_cache_memory_gib=0.25, kv_eviction=policy, kv_sink_tokens=sinks,
                                            kv_window_tokens=args.window),
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=4))
    engine = LLMEngine(config, load_model(None, torch.float32, False))
    ids = ids if ids is not None else text_tokens(engine.tokenizer, args.tokens)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    logprobs, held = None, len(ids)
    while engine.has_unfinished():
        for request in engine.scheduler.running:
            held = request.num_computed_tokens - request.num_evicted_tokens
        for out in engine.step():
            logprobs = out.prompt_logprobs or logprobs
    if policy == "none":
        held = len(ids)  # it holds every token (the loop above last saw it before its final chunk)
    return [(lp.logprob, lp.top[0][0]) for lp in logprobs], held, engine.info.kv_bytes_per_token, ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score-from", type=int, default=384)
    args = p.parse_args(argv)
    if args.tokens >= args.context:
        p.error("--tokens must be below --context: the dense run holds the whole text")
    dense, held, per_token, ids = run(args, "none", 0)
    scored = slice(args.score_from - 1, None)
    base = -sum(lp for lp, _ in dense[scored]) / len(dense[scored])
    print(f"text: {len(ids)} tokens of pydoc_data.topics, scored from {args.score_from}; window {args.window}, "
          f"chunk {args.chunk}, context {args.context}")
    print("| policy | NLL | delta | top-1 agreement | KV bytes/token held |")
    print("|---|---|---|---|---|")
    print(f"| dense | {base:.3f} | 0 | 1.000 | {per_token * held / len(ids):,.0f} |")
    for name, sinks in ((f"streaming, {args.sinks} sinks", args.sinks), ("streaming, window only", 0)):
        rows, held, per_token, _ = run(args, "streaming", sinks, ids)
        nll = -sum(lp for lp, _ in rows[scored]) / len(rows[scored])
        agree = sum(a[1] == b[1] for a, b in zip(rows[scored], dense[scored])) / len(rows[scored])
        print(f"| {name} | {nll:.3f} | {nll - base:+.3f} | {agree:.3f} | {per_token * held / len(ids):,.0f} |")


if __name__ == "__main__":
    main()
