"""Single-stream decode, prefill and memory of kvserve on any GGUF, per ``weights_resident`` mode.

Each mode runs in its own process (so its peak RSS is its own): load, then for each context
length one greedy request (prefix caching off) stepped by hand: the prefill until its first
token, then each decode step timed on its own (tok/s over all steps, and the median step).

With several ``--decode-path`` choices the decode steps of one request take them in turn
(step 1 python, step 2 native, ...), so both are measured side by side under the same load
and context; ``native_over_python`` is the ratio of their tok/s. ``--activation-quant none int8``
alternates the same way (``int8_over_none``; ``LlamaForCausalLM.set_activation_quant``).

    python -m bench.probes.gguf_decode [--model FILE.gguf] [--resident dense blocks] [--ctx 50 1000]
    python -m bench.probes.gguf_decode --decode-path python native   # the default model, both paths
    python -m bench.probes.gguf_decode --model ~/.cache/kvserve-bench/random-1b-16l-Q4_K_M.gguf --resident blocks \
        --activation-quant none int8                            # fp32 vs int8 activations, side by side
    python -m bench.probes.gguf_decode --model "$(python -m bench.make_gguf | cut -d' ' -f1)" --resident blocks
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def _rss_mb() -> float:
    """VmRSS in MB (10^6 bytes, as every other size this bench prints)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def measure(model: str, resident: str, contexts: Sequence[int], tokens: int, threads: int,
            kv_gib: float, decode_paths: Sequence[str] = ("auto",),
            activation_quants: Sequence[str] = ("none",)) -> dict[str, Any]:
    """One mode, in this process."""
    import random

    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvtypes.sampling_params import SamplingParams
    from scheduler.config import SchedulerConfig

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=model, num_threads=threads, weights_resident=resident, max_model_len=4096,
                          activation_quant=activation_quants[0]),
        cache=CacheConfig(kv_cache_memory_gib=kv_gib, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16)))
    load_s = time.perf_counter() - start
    held = engine.runner.model.weight_bytes()
    out: dict[str, Any] = {"resident": resident, "load_s": round(load_s, 1), "rss_after_load_mb": round(_rss_mb()),
                           "weights_blocks_mb": round(held["blocks"] / 1e6), "weights_dense_mb": round(held["dense"] / 1e6),
                           "kv_pool_mb": round(engine.capacity.num_blocks * engine.capacity.block_size
                                               * engine.capacity.bytes_per_token / 1e6),
                           "linear_backend": engine.runner.model.linear_backend, "runs": []}
    lm = engine.runner.model
    vocab = engine.arch.vocab_size
    rng = random.Random(0)
    for ctx in contexts:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(ctx)]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        produced = 0
        while produced == 0:  # prefill (in chunks of max_num_batched_tokens) up to the first token
            produced += sum(len(o.new_token_ids) for o in engine.step())
        t1 = time.perf_counter()
        variants = [(p, q) for p in decode_paths for q in activation_quants]
        steps: dict[str, list[float]] = {}
        done = 0
        while engine.has_unfinished():
            path, quant = variants[done % len(variants)]
            lm.select_decode_path(path)
            if len(activation_quants) > 1:
                lm.set_activation_quant(quant)
            s0 = time.perf_counter()
            engine.step()
            key = "_".join(([path] if len(decode_paths) > 1 else []) + ([quant] if len(activation_quants) > 1 else []))
            steps.setdefault(key, []).append(time.perf_counter() - s0)
            done += 1
        run: dict[str, Any] = {"ctx": ctx, "prefill_s": round(t1 - t0, 2)}
        for path, times in steps.items():
            times.sort()
            key = f"{path}_" if path else ""
            run[f"{key}decode_tok_s"] = round(len(times) / sum(times), 1)
            run[f"{key}decode_median_ms"] = round(times[len(times) // 2] * 1e3, 1)
        if {"native", "python"} <= set(decode_paths):
            run["native_over_python"] = round(run["native_decode_tok_s"] / run["python_decode_tok_s"], 2)
        if set(activation_quants) == {"none", "int8"} and len(decode_paths) == 1:
            run["int8_over_none"] = round(run["int8_decode_tok_s"] / run["none_decode_tok_s"], 2)
        out["runs"].append(run)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6)  # ru_maxrss: KiB
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a .gguf file (default: the default model's SmolLM2 Q4_1)")
    parser.add_argument("--resident", nargs="+", default=["dense", "blocks"], choices=["dense", "blocks", "auto"])
    parser.add_argument("--ctx", type=int, nargs="+", default=[50, 1000])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--decode-path", nargs="+", default=["auto"], choices=["auto", "native", "python"],
                        help="several: the decode steps take them in turn (see above)")
    parser.add_argument("--activation-quant", nargs="+", default=["none"], choices=["none", "int8"],
                        help="several: the decode steps take them in turn (see above)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, metavar="GIB")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.loader import default_gguf_path

        args.model = str(default_gguf_path())
    if args.child:
        result = measure(args.model, args.resident[0], args.ctx, args.tokens, args.num_threads, args.kv_cache_memory,
                         args.decode_path, args.activation_quant)
        print(json.dumps(result))
        return [result]
    results = []
    file_mb = Path(args.model).stat().st_size / 1e6
    for mode in args.resident:
        cmd = [sys.executable, "-m", "bench.probes.gguf_decode", "--child", "--model", args.model, "--resident", mode,
               "--ctx", *map(str, args.ctx), "--tokens", str(args.tokens), "--num-threads", str(args.num_threads),
               "--kv-cache-memory", str(args.kv_cache_memory), "--decode-path", *args.decode_path,
               "--activation-quant", *args.activation_quant]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{mode}: failed\n{done.stderr[-3000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["file_mb"] = round(file_mb)
        result["peak_over_file_plus_kv"] = round(result["peak_rss_mb"] / (file_mb + result["kv_pool_mb"]), 2)
        results.append(result)
        print(json.dumps(result))
    return results


if __name__ == "__main__":
    main()
