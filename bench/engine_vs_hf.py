"""kvserve's LLMEngine against transformers ``generate`` on the same weights, in one process.

Two measurements, both greedy, fp32, exactly the same number of new tokens on both sides
(EOS is masked until then: ``min_tokens`` / ``min_new_tokens``):

* single stream: one prompt at a time; decode tokens/s = (new tokens - 1) / (time from the
  first new token to the last), so prefill is left out on both sides; TTFT is reported too.
* batch: N prompts generated together (kvserve: one ``generate`` call, continuous batching;
  transformers: one left-padded batched ``generate``); output tokens/s over the whole call,
  prefill included.

Single stream is also reported as a fraction of each side's memory-bandwidth bound: read
bandwidth measured in this run (a ``sum`` over 1 GiB) divided by the weight bytes one decode
token streams (all layer weights + LM head): dense fp32 for transformers, the GGUF blocks
for kvserve where its decode matmuls read them (``linear_backend: gguf``).

    python -m bench.engine_vs_hf            # default model, full run (~1-2 min)
    python -m bench.engine_vs_hf --quick    # fewer tokens, smoke test
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import torch

from bench.common import (CpuMonitor, chat_prompts, load_default_pair, machine_info, memory_bandwidth_gbs,
                          hf_weight_bytes_per_decode_token, print_table, ratio, verdict, wait_for_quiet,
                          weight_bytes_per_decode_token,
                          write_results)
from kvtypes.sampling_params import SamplingParams

SINGLE_TARGET = 1.5  # kvserve / HF, single-stream decode tokens/s
BATCH_TARGET = 2.0  # kvserve / HF, batched output tokens/s


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


class _TimingStreamer:
    """transformers streamer that records when each new token arrives (batch size 1)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_single(model: Any, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, streamer=streamer,
                             pad_token_id=_pad_id(model))
    end = time.perf_counter()
    return {"tokens": out[0, ids.shape[1]:].tolist(), "ttft_s": streamer.times[0] - start,
            "decode_s": end - streamer.times[0]}


def kvserve_batch(engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    results = engine.generate([list(p) for p in prompts], _params(new_tokens))
    elapsed = time.perf_counter() - start
    return {"tokens": [r.token_ids for r in results], "elapsed_s": elapsed,
            "cached_prompt_tokens": sum(r.num_cached_tokens for r in results)}


def hf_batch(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    """One left-padded batched ``generate`` call."""
    pad = _pad_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return {"tokens": out[:, width:].tolist(), "elapsed_s": elapsed}


def _pad_id(model: Any) -> int:
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "pad_token_id", None), getattr(model.config, "pad_token_id", None),
                  getattr(gen, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def run_engine_vs_hf(engine: Any, hf_model: Any, single_prompts: Sequence[Sequence[int]],
                     batch_prompts: Sequence[Sequence[int]], single_new_tokens: int = 128,
                     batch_new_tokens: int = 128, warmup_prompt: Sequence[int] | None = None,
                     measure_bandwidth: bool = True, quiet_wait_s: float = 0.0,
                     bandwidth_mib: int = 1024) -> dict[str, Any]:
    """Run both measurements; return a JSON-ready dict with throughputs, ratios and verdicts.

    ``quiet_wait_s`` > 0: before each timed phase wait up to that long for other processes
    to leave the cores alone.
    """
    def settle() -> None:
        if quiet_wait_s > 0:
            wait_for_quiet(quiet_wait_s)

    warmup_prompt = list(warmup_prompt or single_prompts[0])
    warm = max(2, min(8, single_new_tokens))
    # Warm up both sides, single and batched shapes (allocator, oneDNN/MKL kernel selection).
    kvserve_single(engine, warmup_prompt, warm)
    hf_single(hf_model, warmup_prompt, warm)
    kvserve_batch(engine, batch_prompts[:4], warm)
    hf_batch(hf_model, batch_prompts[:4], warm)
    engine.kv_cache.reset_prefix_cache()

    single = {"kvserve": [], "hf": []}
    settle()
    with CpuMonitor() as single_cpu:
        for prompt in single_prompts:
            single["kvserve"].append(kvserve_single(engine, prompt, single_new_tokens))
            single["hf"].append(hf_single(hf_model, prompt, single_new_tokens))
    engine.kv_cache.reset_prefix_cache()

    def decode_tps(runs: list[dict[str, Any]]) -> float:
        return sum(len(r["tokens"]) - 1 for r in runs) / sum(r["decode_s"] for r in runs)

    single_k, single_h = decode_tps(single["kvserve"]), decode_tps(single["hf"])
    single_match = sum(a["tokens"] == b["tokens"] for a, b in zip(single["kvserve"], single["hf"]))

    settle()
    with CpuMonitor() as batch_k_cpu:
        batch_k = kvserve_batch(engine, batch_prompts, batch_new_tokens)
    settle()
    with CpuMonitor() as batch_h_cpu:
        batch_h = hf_batch(hf_model, batch_prompts, batch_new_tokens)
    engine.kv_cache.reset_prefix_cache()
    n_out = len(batch_prompts) * batch_new_tokens
    batch_k_tps, batch_h_tps = n_out / batch_k["elapsed_s"], n_out / batch_h["elapsed_s"]
    batch_match = sum(a == b for a, b in zip(batch_k["tokens"], batch_h["tokens"]))

    result: dict[str, Any] = {
        "benchmark": "engine_vs_hf",
        "machine": machine_info(),
        "single_stream": {
            "prompts": len(single_prompts), "new_tokens": single_new_tokens,
            "kvserve_decode_tps": round(single_k, 2), "hf_decode_tps": round(single_h, 2),
            "kvserve_ttft_ms": round(1000 * sum(r["ttft_s"] for r in single["kvserve"]) / len(single_prompts), 1),
            "hf_ttft_ms": round(1000 * sum(r["ttft_s"] for r in single["hf"]) / len(single_prompts), 1),
            "ratio": ratio(single_k, single_h), "target": SINGLE_TARGET,
            "verdict": verdict(ratio(single_k, single_h), SINGLE_TARGET),
            "token_match": f"{single_match}/{len(single_prompts)}",
            "foreign_cpu_cores": single_cpu.foreign_cores,
        },
        "batch": {
            "batch_size": len(batch_prompts), "new_tokens": batch_new_tokens,
            "prompt_tokens": [len(p) for p in batch_prompts],
            "kvserve_tps": round(batch_k_tps, 2), "hf_tps": round(batch_h_tps, 2),
            "kvserve_s": round(batch_k["elapsed_s"], 3), "hf_s": round(batch_h["elapsed_s"], 3),
            "kvserve_cached_prompt_tokens": batch_k["cached_prompt_tokens"],
            "ratio": ratio(batch_k_tps, batch_h_tps), "target": BATCH_TARGET,
            "verdict": verdict(ratio(batch_k_tps, batch_h_tps), BATCH_TARGET),
            # HF's left padding shifts numerics a little, so a mismatch here is informative only.
            "token_match": f"{batch_match}/{len(batch_prompts)}",
            "foreign_cpu_cores": {"kvserve": batch_k_cpu.foreign_cores, "hf": batch_h_cpu.foreign_cores},
        },
    }
    if measure_bandwidth:
        bandwidth = memory_bandwidth_gbs(bandwidth_mib)
        per_token = weight_bytes_per_decode_token(engine)
        hf_per_token = hf_weight_bytes_per_decode_token(hf_model)
        bound, hf_bound = bandwidth * 1e9 / per_token, bandwidth * 1e9 / hf_per_token
        result["bandwidth"] = {
            "read_gbs": round(bandwidth, 2), "weight_bytes_per_token": per_token,
            "bound_tps": round(bound, 2), "kvserve_fraction": round(single_k / bound, 3),
            "hf_weight_bytes_per_token": hf_per_token, "hf_bound_tps": round(hf_bound, 2),
            "hf_fraction": round(single_h / hf_bound, 3),
        }
    return result


def print_report(result: dict[str, Any]) -> None:
    s, b = result["single_stream"], result["batch"]
    m = result["machine"]
    print(f"\nengine_vs_hf  torch {m['torch']}  transformers {m['transformers']}  threads {m['threads']}  "
          f"load(1m) {m['loadavg_1m']}")
    rows = [
        [f"single stream decode ({s['prompts']} x {s['new_tokens']} tok)", s["kvserve_decode_tps"],
         s["hf_decode_tps"], s["ratio"], f">= {s['target']}", s["verdict"]],
        [f"batch {b['batch_size']} x {b['new_tokens']} tok (prefill incl.)", b["kvserve_tps"], b["hf_tps"],
         b["ratio"], f">= {b['target']}", b["verdict"]],
    ]
    print_table("output tokens/s", rows, ["measurement", "kvserve", "HF", "ratio", "target", "verdict"])
    print(f"  TTFT single stream: kvserve {s['kvserve_ttft_ms']} ms, HF {s['hf_ttft_ms']} ms; "
          f"greedy tokens equal: single {s['token_match']}, batch {b['token_match']}")
    foreign = [s["foreign_cpu_cores"], *b["foreign_cpu_cores"].values()]
    if any(f is not None and f > 0.3 for f in foreign):
        print(f"  WARNING: other processes used {foreign} cores during (single, batch kvserve, batch HF): "
              "2-thread matmuls slow down badly under contention; rerun on a quiet machine")
    if "bandwidth" in result:
        bw = result["bandwidth"]
        print(f"  memory bandwidth {bw['read_gbs']} GB/s; weights streamed per decode token: kvserve "
              f"{bw['weight_bytes_per_token'] / 1e6:.0f} MB (bound {bw['bound_tps']} tok/s, at "
              f"{bw['kvserve_fraction']:.0%}), HF {bw['hf_weight_bytes_per_token'] / 1e6:.0f} MB (bound "
              f"{bw['hf_bound_tps']} tok/s, at {bw['hf_fraction']:.0%})")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_vs_hf", description=__doc__.split("\n")[0])
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument("--single-prompts", type=int, default=3)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens, batch 16 x 32 tokens")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each timed phase wait up to this many seconds for a quiet CPU (0: don't)")
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/engine_vs_hf-<time>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.single_prompts, args.single_tokens, args.batch_tokens = 2, 32, 32

    engine, hf = load_default_pair(args.num_threads, max_num_seqs=max(64, args.batch_size))
    tok = engine.tokenizer
    single = chat_prompts(tok, args.single_prompts, offset=1)
    batch = chat_prompts(tok, args.batch_size, offset=1 + args.single_prompts)
    warm = chat_prompts(tok, 1, offset=0)[0]
    result = run_engine_vs_hf(engine, hf, single, batch, args.single_tokens, args.batch_tokens, warm,
                              quiet_wait_s=args.quiet_wait)
    print_report(result)
    path = write_results("engine_vs_hf", result, args.output)
    print(f"  results: {path}")
    return result


if __name__ == "__main__":
    main()
