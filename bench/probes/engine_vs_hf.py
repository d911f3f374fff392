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

    python -m bench.probes.engine_vs_hf            # default model, full run (~1-2 min)
    python -m bench.probes.engine_vs_hf --quick    # fewer tokens, smoke test
"""
from __future__ import annotations

import argparse
from typing import Any, Sequence

from bench.engine_runs import kvserve_batch, kvserve_single, load_default_pair, weight_bytes_per_decode_token
from bench.machine import CpuMonitor, machine_info, memory_bandwidth_gbs, wait_for_quiet
from bench.peers.transformers import hf_batch, hf_single, hf_weight_bytes_per_decode_token
from bench.report import print_table, ratio, verdict, write_results
from bench.workload import chat_prompts

SINGLE_TARGET = 1.5  # kvserve / HF, single-stream decode tokens/s
BATCH_TARGET = 2.0  # kvserve / HF, batched output tokens/s


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
    parser = argparse.ArgumentParser(prog="python -m bench.probes.engine_vs_hf", description=__doc__.split("\n")[0])
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
