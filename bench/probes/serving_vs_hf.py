"""Offline serving throughput: kvserve's async engine against transformers, same requests.

The workload: N requests (default 64) with mixed prompt lengths (default 50-1,000 tokens)
and output lengths (default 16-256 tokens), drawn from a fixed seed, all submitted at once.
Every side generates exactly each request's output length (EOS is ignored / masked), and
throughput counts only those requested tokens:

* kvserve: ``InprocEngineClient`` (the engine core loop in a thread + asyncio clients), one ``generate`` stream
  per request, continuous batching over the paged KV cache;
* transformers static batching: ``generate`` on batches of ``--hf-batch-size`` requests in
  arrival order, left-padded; each batch runs until its longest output is done (the tokens
  generated past a shorter request's length are waste and are not counted);
* transformers continuous batching: ``model.generate_batch`` machinery (the
  ``ContinuousBatchingManager`` from ``init_continuous_batching``, which takes a per-request
  ``max_new_tokens``). If it cannot run here it is reported as skipped, with the reason.

    python -m bench.probes.serving_vs_hf            # 64 requests
    python -m bench.probes.serving_vs_hf --quick    # 12 short requests, smoke test
"""
from __future__ import annotations

import argparse
import traceback
from typing import Any, Sequence

from bench.engine_runs import load_default_pair, run_kvserve
from bench.machine import CpuMonitor, machine_info, wait_for_quiet
from bench.peers.transformers import ContinuousTimeout, run_hf_continuous, run_hf_static
from bench.report import print_table, ratio, verdict, write_results
from bench.workload import BenchRequest, make_requests

STATIC_TARGET = 2.0  # kvserve / HF static batched generate
CB_TARGET = 1.5  # kvserve / HF continuous batching


def run_serving_vs_hf(engine: Any, hf_model: Any, requests: Sequence[BenchRequest], hf_batch_size: int = 16,
                      continuous: bool = True, quiet_wait_s: float = 0.0, warmup: bool = True,
                      cb_timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the three sides on ``requests``; a JSON-ready dict with tokens/s, ratios and verdicts."""
    def settle() -> None:
        if quiet_wait_s > 0:
            wait_for_quiet(quiet_wait_s)

    if warmup:  # kernels, allocator, the first generate() call of transformers
        small = [BenchRequest(r.prompt_token_ids[:32], 4) for r in requests[:2]]
        run_kvserve(engine, small)
        run_hf_static(hf_model, small, hf_batch_size)
        engine.kv_cache.reset_prefix_cache()

    expected = sum(r.output_len for r in requests)
    sides: dict[str, Any] = {}
    settle()
    with CpuMonitor() as cpu:
        sides["kvserve"] = run_kvserve(engine, requests)
    sides["kvserve"]["foreign_cpu_cores"] = cpu.foreign_cores
    engine.kv_cache.reset_prefix_cache()
    settle()
    with CpuMonitor() as cpu:
        sides["hf_static"] = run_hf_static(hf_model, requests, hf_batch_size)
    sides["hf_static"]["foreign_cpu_cores"] = cpu.foreign_cores
    if continuous:
        settle()
        try:
            with CpuMonitor() as cpu:
                sides["hf_continuous"] = run_hf_continuous(hf_model, requests, cb_timeout_s)
            sides["hf_continuous"]["foreign_cpu_cores"] = cpu.foreign_cores
        except ContinuousTimeout as exc:
            # Unfinished after T seconds means it produced fewer than all the workload's tokens
            # in T seconds: expected / T bounds its throughput from above, so the ratio below
            # is a lower bound on kvserve's advantage.
            sides["hf_continuous"] = {"timed_out": str(exc), "finished_requests": exc.finished,
                                      "tps_upper_bound": round(expected / exc.timeout_s, 2)}
        except Exception as exc:  # noqa: BLE001 - reported, never silently dropped
            sides["hf_continuous"] = {"skipped": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc(limit=3)}
    else:
        sides["hf_continuous"] = {"skipped": "disabled with --no-continuous"}

    for side in sides.values():
        if "elapsed_s" in side:
            side["tps"] = round(side["output_tokens"] / side["elapsed_s"], 2)
            side["elapsed_s"] = round(side["elapsed_s"], 3)
    k = sides["kvserve"]["tps"]
    result: dict[str, Any] = {
        "benchmark": "serving_vs_hf",
        "machine": machine_info(),
        "workload": {"requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "output_tokens": expected,
                     "prompt_len_range": [min(len(r.prompt_token_ids) for r in requests),
                                          max(len(r.prompt_token_ids) for r in requests)],
                     "output_len_range": [min(r.output_len for r in requests), max(r.output_len for r in requests)]},
        **sides,
        "ratio_vs_static": ratio(k, sides["hf_static"]["tps"]), "target_vs_static": STATIC_TARGET,
        "verdict_vs_static": verdict(ratio(k, sides["hf_static"]["tps"]), STATIC_TARGET),
    }
    if "tps" in sides["hf_continuous"]:
        r = ratio(k, sides["hf_continuous"]["tps"])
        result.update(ratio_vs_continuous=r, target_vs_continuous=CB_TARGET, verdict_vs_continuous=verdict(r, CB_TARGET))
    elif "tps_upper_bound" in sides["hf_continuous"]:
        r = ratio(k, sides["hf_continuous"]["tps_upper_bound"])
        result.update(ratio_vs_continuous=r, ratio_vs_continuous_is_lower_bound=True, target_vs_continuous=CB_TARGET,
                      verdict_vs_continuous=verdict(r, CB_TARGET))
    else:
        result.update(ratio_vs_continuous=None, target_vs_continuous=CB_TARGET, verdict_vs_continuous="SKIPPED")
    return result


def print_report(result: dict[str, Any]) -> None:
    m, w = result["machine"], result["workload"]
    print(f"\nserving_vs_hf  {w['requests']} requests, prompts {w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} "
          f"tokens ({w['prompt_tokens']} in all), outputs {w['output_len_range'][0]}-{w['output_len_range'][1]} "
          f"({w['output_tokens']} in all); threads {m['threads']}, load(1m) {m['loadavg_1m']}")
    rows = []
    names = {"kvserve": "kvserve engine client", "hf_static": f"HF generate, static batches of "
             f"{result['hf_static'].get('batch_size')}", "hf_continuous": "HF continuous batching"}
    for key, name in names.items():
        side = result[key]
        if "tps_upper_bound" in side:
            rows.append([name, f"< {side['tps_upper_bound']}", "-", f">= {result['ratio_vs_continuous']}",
                         f">= {CB_TARGET}", f"{result['verdict_vs_continuous']}  ({side['timed_out']})"])
            continue
        if "tps" not in side:
            rows.append([name, "skipped", "-", "-", "-", side.get("skipped")])
            continue
        if key == "kvserve":
            rows.append([name, side["tps"], side["elapsed_s"], "", "", f"other procs {side['foreign_cpu_cores']} cores"])
        else:
            which = "static" if key == "hf_static" else "continuous"
            rows.append([name, side["tps"], side["elapsed_s"], result[f"ratio_vs_{which}"],
                         f">= {result[f'target_vs_{which}']}",
                         f"{result[f'verdict_vs_{which}']}  (other procs {side['foreign_cpu_cores']} cores)"])
    print_table("output tokens/s", rows, ["side", "tok/s", "seconds", "kvserve/x", "target", "verdict"])
    if "ttft_median_s" in result["kvserve"]:
        print(f"  kvserve median TTFT {result['kvserve']['ttft_median_s']:.2f} s over {result['kvserve']['steps']} steps")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.serving_vs_hf", description=__doc__.split("\n")[0])
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(50, 1000), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--no-continuous", action="store_true", help="skip transformers' continuous batching")
    parser.add_argument("--quick", action="store_true", help="12 requests, prompts 20-200, outputs 8-32")
    parser.add_argument("--quiet-wait", type=float, default=30.0,
                        help="before each timed side wait up to this many seconds for a quiet CPU (0: don't)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cb-timeout", type=float, default=600.0,
                        help="seconds transformers' continuous batching may take (unfinished: a throughput bound)")
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/serving_vs_hf-<time>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 12, (20, 200), (8, 32)

    engine, hf = load_default_pair(args.num_threads, kv_cache_gib=args.kv_cache_gib,
                                   max_num_seqs=max(64, args.requests))
    requests = make_requests(args.requests, tuple(args.prompt_len), tuple(args.output_len),
                             engine.arch.vocab_size, args.seed)
    result = run_serving_vs_hf(engine, hf, requests, args.hf_batch_size, not args.no_continuous, args.quiet_wait,
                               cb_timeout_s=args.cb_timeout)
    print_report(result)
    path = write_results("serving_vs_hf", result, args.output)
    print(f"  results: {path}")
    return result


if __name__ == "__main__":
    main()
