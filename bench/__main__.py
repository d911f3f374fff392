"""kvserve's benchmark suite against its peers, side by side (``python -m bench`` or ``kvserve bench``).

    python -m bench serve-load [--url URL] [--concurrency 1 4 16 32] ...
    python -m bench peers        # transformers generate / continuous batching, llama.cpp
    python -m bench llama-server # kvserve vs llama.cpp's own server (scripts/llama-server-peer.sh)
    python -m bench kv-cache     # the KV-cache experiment: with vs without a cache
    python -m bench prefix       # TTFT on a prefix-cache miss vs a hit
    python -m bench kv-memory    # slot utilization and concurrency in a fixed KV budget
    python -m bench kv-tier      # TTFT of a 2,000-token prefix restored from the disk tier vs a miss
    python -m bench roofline     # matmul GFLOP/s and memory bandwidth vs kvserve
    python -m bench structured   # constrained vs free decoding at 16 streams; compile stalls
    python -m bench all [--quick] [--benchmarks-md BENCHMARKS.md]
    python -m bench report       # rewrite BENCHMARKS.md from the last `all` run's JSON

Every scenario writes ``<output-dir>/<scenario>.json`` and ``.md`` (and ``.png`` plots) and
prints PASS/FAIL lines for the issue's targets; ``all`` adds ``summary.json`` / ``summary.md``.
Scenarios that need a server start ``kvserve serve`` as a subprocess on a free port (or use
``--url``); the in-process ones load the default model (SmolLM2-135M-Instruct) in this process.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.context import Context
from bench.machine import CpuMonitor, cpu_model, machine_info, mem_total_gib
from bench.report import (FAIL, PASS, RESULTS_DIR, SKIPPED, check_line, print_result, summary_markdown,
                          write_benchmarks_md, write_scenario)
from bench.workload import chat_prompts

SCENARIOS = ("serve-load", "peers", "llama-server", "kv-cache", "prefix", "kv-memory", "roofline", "structured",
             "kv-tier")


# ---- scenarios -------------------------------------------------------------------------------------
def _q(args: argparse.Namespace, name: str, full: Any, quick: Any) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    return quick if args.quick else full


def scenario_serve_load(ctx: Context) -> dict[str, Any]:
    from bench.serve_load import default_requests_for, run_serve_load

    a = ctx.args
    vocab, _ = ctx.vocab_and_eos()
    per_level = _q(a, "requests_per_level", None, None)
    return run_serve_load(
        ctx.server, vocab, levels=_q(a, "concurrency", (1, 4, 16, 32), (1, 4, 16, 32)),
        prompt_len=_q(a, "prompt_len", 192, 96), output_len=_q(a, "output_len", 64, 16),
        shared_prefix=_q(a, "shared_prefix", 64, 32),
        requests_for=(lambda c: per_level) if per_level else default_requests_for(a.quick),
        seed=a.seed, progress=not a.no_progress, out_dir=ctx.out)


def scenario_peers(ctx: Context) -> dict[str, Any]:
    from bench.vs_peers import ALL_PEERS, run_peers

    a = ctx.args
    peers = [p.strip() for p in (a.peers or ",".join(ALL_PEERS)).split(",") if p.strip()]
    unknown = set(peers) - set(ALL_PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {', '.join(ALL_PEERS)}")
    vocab, eos = ctx.vocab_and_eos()
    hf = ctx.hf if {"hf", "hf-cb"} & set(peers) else None
    engine = None if a.no_engine else ctx.engine
    return run_peers(ctx.server, hf, ctx.tokenizer, vocab, eos, ctx.threads, peers,
                     prompt_len=_q(a, "prompt_len", 128, 64), output_len=_q(a, "output_len", 64, 8),
                     single_requests=_q(a, "single_requests", 2, 1), batch_size=_q(a, "batch_size", 32, 32),
                     batch_waves=_q(a, "batch_waves", 1, 1), seed=a.seed + 7,
                     gguf=getattr(a, "gguf", None),
                     install=not getattr(a, "no_install", False),
                     progress=not a.no_progress, out_dir=ctx.out, quiet_wait_s=ctx.quiet_wait(), engine=engine)


def served_model(serve_args: list[str]) -> str | None:
    """The ``--model`` among the ``--serve-arg``s (``--model=PATH`` or ``--model`` then ``PATH``), if any."""
    for i, arg in enumerate(serve_args):
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
        if arg == "--model" and i + 1 < len(serve_args):
            return serve_args[i + 1]
    return None


def scenario_llama_server(ctx: Context) -> dict[str, Any]:
    from bench.vs_llama_server import DEFAULT_CONTEXTS, DEFAULT_LEVELS, run_vs_llama_server

    a = ctx.args
    vocab, _ = ctx.vocab_and_eos()
    agreement = not getattr(a, "no_agreement", False)
    served = served_model(a.serve_arg or [])
    hf = ctx.hf if agreement else None
    # The in-process engine is the default model: it stands for the server only when that serves the default.
    engine = ctx.engine if agreement and served is None else None
    return run_vs_llama_server(ctx.server, engine, hf, ctx.tokenizer, vocab, ctx.threads, served_gguf=served,
                               contexts=_q(a, "contexts", DEFAULT_CONTEXTS, DEFAULT_CONTEXTS),
                               levels=_q(a, "concurrency", DEFAULT_LEVELS, DEFAULT_LEVELS),
                               output_len=_q(a, "output_len", 128, 32),
                               stream_prompt_len=_q(a, "stream_prompt_len", 50, 50),
                               single_requests=_q(a, "single_requests", 3, 1), waves=_q(a, "waves", 2, 1),
                               gguf=getattr(a, "llama_gguf", None), seed=a.seed, progress=not a.no_progress,
                               out_dir=ctx.out, agreement=agreement, rounds=_q(a, "rounds", 3, 1))


def scenario_kv_cache(ctx: Context) -> dict[str, Any]:
    from bench.kv_cache import DEFAULT_CONTEXTS, run_kv_cache

    a = ctx.args
    engine, hf = ctx.engine, ctx.hf
    contexts = _q(a, "contexts", DEFAULT_CONTEXTS, tuple(c for c in DEFAULT_CONTEXTS if c <= 256))
    prompt = chat_prompts(engine.tokenizer, 1, offset=2)[0]
    return run_kv_cache(engine, hf, prompt, engine.arch.vocab_size, new_tokens=_q(a, "new_tokens", 32, 8),
                        contexts=contexts, repeats=_q(a, "repeats", 3, 2), out_dir=ctx.out)


def scenario_prefix(ctx: Context) -> dict[str, Any]:
    from bench.prefix import run_prefix

    a = ctx.args
    return run_prefix(ctx.server, ctx.tokenizer, system_tokens=_q(a, "system_tokens", 1000, 1000),
                      rounds=_q(a, "rounds", 6, 2), progress=not a.no_progress)


def scenario_structured(ctx: Context) -> dict[str, Any]:
    from bench.structured import run_structured

    a = ctx.args
    vocab, _ = ctx.vocab_and_eos()
    return run_structured(ctx.server, ctx.tokenizer, vocab, concurrency=_q(a, "concurrency", 16, 16),
                          output_len=_q(a, "output_len", 48, 24), rounds=_q(a, "rounds", 2, 1),
                          inject=_q(a, "inject", 8, 4), gap_rounds=_q(a, "gap_rounds", 3, 1),
                          progress=not a.no_progress)


def scenario_kv_memory(ctx: Context) -> dict[str, Any]:
    from bench.kv_memory import build_engine, run_kv_memory
    from bench.workload import make_requests

    a = ctx.args
    max_len = _q(a, "max_model_len", 2048, 1024)
    budget = _q(a, "budget_tokens", 4 * max_len, 4 * max_len)
    engine = build_engine(max_len, budget, num_threads=ctx.threads)
    try:
        requests = make_requests(_q(a, "requests", 48, 24), tuple(_q(a, "prompt_range", (64, 512), (96, 384))),
                                 tuple(_q(a, "output_range", (16, 128), (8, 32))), engine.arch.vocab_size,
                                 seed=a.seed + 11)
        return run_kv_memory(engine, requests, progress=not a.no_progress, out_dir=ctx.out)
    finally:
        del engine
        gc.collect()


def roofline_model(choice: str | None) -> Path | None:
    """The GGUF ``roofline --gguf`` measures: None for the default model (also for "Q4_1", the
    shipped file it loads), a ``SAME_FILE_CHOICES`` name's file (made and cached on first use, as
    ``llama-server --gguf`` makes it), or an existing ``.gguf`` path."""
    from bench.vs_llama_server import SAME_FILE_CHOICES, same_file_gguf

    if choice in (None, "Q4_1"):
        return None
    if choice in SAME_FILE_CHOICES:
        return same_file_gguf(choice)
    path = Path(choice).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--gguf must be one of {', '.join(SAME_FILE_CHOICES)} or a .gguf file, not {choice!r}")
    return path


def scenario_roofline(ctx: Context) -> dict[str, Any]:
    from bench.engine_runs import load_engine
    from bench.roofline import BREAKDOWN_ROWS, run_roofline

    a = ctx.args
    path = roofline_model(getattr(a, "gguf", None))  # no --gguf under `all`: the default model
    engine = ctx.engine if path is None else load_engine(str(path), ctx.threads, kv_cache_gib=0.5)
    tok = engine.tokenizer
    single = chat_prompts(tok, _q(a, "single_requests", 2, 1), offset=3)
    batch = chat_prompts(tok, _q(a, "batch_size", 32, 16), offset=5)
    result = run_roofline(engine, single, batch, new_tokens=_q(a, "new_tokens", 32, 16),
                          matmul_n=_q(a, "matmul_n", 2048, 1024), bandwidth_mib=_q(a, "bandwidth_mib", 1024, 512),
                          out_dir=ctx.out, rows_levels=_q(a, "rows", BREAKDOWN_ROWS, BREAKDOWN_ROWS),
                          step_tokens=_q(a, "step_tokens", 64, 16))
    if path is not None:
        result["model"]["gguf"] = str(path)
        result["notes"].insert(0, f"Model: {path} (roofline --gguf), at the CPU defaults.")
    return result


def scenario_kv_tier(ctx: Context) -> dict[str, Any]:
    from bench.kv_tier import build_engine, run_kv_tier

    a = ctx.args
    prefix = _q(a, "prefix_tokens", 2000, 2000)
    vocab, _ = ctx.vocab_and_eos()
    tp = getattr(a, "tensor_parallel_size", None) or 1  # absent under `bench all`
    return run_kv_tier(lambda folder: build_engine(folder, prefix + 16, num_threads=ctx.threads,
                                                   tensor_parallel_size=tp), vocab,
                       prefix_tokens=prefix, rounds=_q(a, "rounds", 3, 1), progress=not a.no_progress)


RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "serve-load": scenario_serve_load, "peers": scenario_peers, "llama-server": scenario_llama_server,
    "kv-cache": scenario_kv_cache,
    "prefix": scenario_prefix, "kv-memory": scenario_kv_memory, "roofline": scenario_roofline,
    "structured": scenario_structured,
    "kv-tier": scenario_kv_tier,
}
# In ``all``: the server scenarios first (one server for the three), then the in-process ones.
ALL_ORDER = ("serve-load", "prefix", "structured", "peers", "llama-server", "kv-cache", "kv-memory", "roofline")


def run_one(name: str, ctx: Context) -> dict[str, Any]:
    print(f"\n=== {name} ===", file=sys.stderr)
    quiet = ctx.quiet_wait()
    if quiet > 0:
        from bench.machine import wait_for_quiet

        wait_for_quiet(quiet)
    t0 = time.perf_counter()
    try:
        from bench.machine import LoadMonitor

        server_pid = (ctx.server.pid if name in ("serve-load", "prefix", "peers", "llama-server", "structured")
                      else None)  # started untimed
        with LoadMonitor([server_pid]) as mon:
            result = RUNNERS[name](ctx)
        result.setdefault("machine", machine_info())["foreign_cpu_cores"] = mon.foreign_cores
    except Exception as exc:  # noqa: BLE001 - one broken scenario must not lose the others
        traceback.print_exc()
        result = {"scenario": name, "title": name, "error": f"{type(exc).__name__}: {exc}", "machine": machine_info(),
                  "checks": [{"name": f"{name} scenario", "value": None, "target": None, "unit": "",
                              "verdict": FAIL, "detail": f"crashed: {type(exc).__name__}: {exc}"}],
                  "notes": [f"The scenario crashed: {type(exc).__name__}: {exc}"], "tables": []}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    path = write_scenario(result, ctx.out)
    print_result(result)
    print(f"  results: {path} ({result['wall_s']} s)")
    return result


# ---- all + BENCHMARKS.md -----------------------------------------------------------------------------


def run_all(args: argparse.Namespace, argv: Sequence[str], prog: str = "python -m bench") -> list[dict[str, Any]]:
    ctx = Context(args)
    skip = {s.strip() for s in (args.skip or "").split(",") if s.strip()}
    started, load_before = time.strftime("%Y-%m-%d %H:%M:%S"), _loadavg()
    t0 = time.perf_counter()
    results = []
    try:
        with CpuMonitor() as cpu:
            for name in ALL_ORDER:
                if name in skip:
                    continue
                if name in ("kv-cache", "kv-memory", "roofline"):
                    ctx.close_server()  # the in-process scenarios get the cores to themselves
                results.append(run_one(name, ctx))
    finally:
        ctx.close()
    run = {"command": f"{prog} " + " ".join(argv), "started": started,
           "scenarios": [r["scenario"] for r in results],
           "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(time.perf_counter() - t0, 1),
           "quick": args.quick, "loadavg_before": load_before, "loadavg_after": _loadavg(),
           "foreign_cpu_cores": cpu.foreign_cores,
           "machine": {**machine_info(), "cpu": cpu_model(), "mem_gib": mem_total_gib()}}
    peers = next((r for r in results if r["scenario"] == "peers" and "sides" in r), None)
    if peers:
        ll = peers["sides"].get("llamacpp", {}).get("single", {})
        run["peers_versions"] = (f"transformers {run['machine']['transformers']}; node-llama-cpp {ll.get('version')} "
                                 f"(llama.cpp {ll.get('llama_cpp_release')})" if "version" in ll else
                                 f"transformers {run['machine']['transformers']}; llama.cpp skipped")
    ls = next((r for r in results if r["scenario"] == "llama-server" and "llama_server" in r), None)
    if ls:
        run["peers_versions"] = (f"{run.get('peers_versions', '-')}; llama-server: "
                                 f"{ls['llama_server'].get('package') or 'skipped'}")
    checks = [c for r in results for c in r.get("checks", [])]
    summary = {"run": run, "checks": checks,
               "counts": {v: sum(c["verdict"] == v for c in checks) for v in (PASS, FAIL, SKIPPED)}}
    out = Path(args.output_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(summary_markdown(results, run) + "\n")
    if args.benchmarks_md:
        write_benchmarks_md(results, run, Path(args.benchmarks_md), Path(args.plots_dir))
        print(f"\nwrote {args.benchmarks_md} (plots in {args.plots_dir})")
    print(f"\n=== summary ({run['wall_s'] / 60:.1f} min, load {load_before} -> {run['loadavg_after']}, other processes "
          f"{cpu.foreign_cores} cores) ===")
    for c in checks:
        if c["verdict"] != "INFO":
            print("  " + check_line(c))
    print(f"  {summary['counts']}")
    return results


def rebuild_report(args: argparse.Namespace) -> None:
    """``report``: rewrite the Markdown report from the JSON files of the last ``all`` run."""
    out = Path(args.output_dir)
    summary = json.loads((out / "summary.json").read_text())
    run = summary["run"]
    names = run.get("scenarios") or [n for n in ALL_ORDER if (out / f"{n}.json").exists()]
    results = [json.loads((out / f"{n}.json").read_text()) for n in names]
    write_benchmarks_md(results, run, Path(args.benchmarks_md), Path(args.plots_dir))
    print(f"wrote {args.benchmarks_md} from {out}/summary.json (plots in {args.plots_dir})")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- the command line -----------------------------------------------------------------------------------
def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("common")
    g.add_argument("--output-dir", default=str(RESULTS_DIR),
                   help="where JSON, Markdown and PNGs go (default %(default)s)")
    g.add_argument("--quick", action="store_true", help="small sizes: the whole suite in a few minutes")
    g.add_argument("--num-threads", type=int, default=None,
                   help="threads for torch, the server and llama.cpp (default: the available cores less those other "
                        "processes keep busy, measured at start)")
    g.add_argument("--quiet-wait", type=float, default=None,
                   help="before each timed side wait up to this many seconds for other processes to go quiet "
                        "(default 10 in a full run on all cores, else 0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    srv = common.add_argument_group("server (serve-load, prefix, peers)")
    srv.add_argument("--url", help="use a running server (e.g. http://127.0.0.1:8000) instead of starting one")
    srv.add_argument("--api-key", help="bearer token for --url")
    srv.add_argument("--serve-arg", action="append", metavar="ARG",
                     help="extra argument for the `kvserve serve` subprocess (repeatable), "
                          "e.g. --serve-arg=--max-num-seqs=64")

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="scenario", required=True)

    p = sub.add_parser("serve-load", parents=[common],
                       help="HTTP load at concurrency 1/4/16/32: tok/s, TTFT, TPOT, hit rate")
    p.add_argument("--concurrency", type=int, nargs="+")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 192; quick 96)")
    p.add_argument("--shared-prefix", type=int,
                   help="leading prompt tokens shared by all requests (default 64; quick 32)")
    p.add_argument("--output-len", type=int, help="output tokens (default 64; quick 16)")
    p.add_argument("--requests-per-level", type=int, help="requests per level (default max(4, 2c); quick max(2, c))")

    p = sub.add_parser("peers", parents=[common], help="kvserve vs transformers (static, continuous) and llama.cpp")
    p.add_argument("--peers", help="comma list of hf, hf-cb, llamacpp (default: all)")
    p.add_argument("--prompt-len", type=int, help="default 128; quick 64")
    p.add_argument("--output-len", type=int, help="default 64; quick 8")
    p.add_argument("--single-requests", type=int, help="single-stream requests (default 2; quick 1)")
    p.add_argument("--batch-size", type=int, help="concurrency / static batch / parallel sequences (default 32)")
    p.add_argument("--batch-waves", type=int, help="batch requests = batch size x waves (default 1)")
    p.add_argument("--gguf", help="the GGUF llama.cpp runs (default: the shipped Q4_1 file, the bytes kvserve's decode "
                                  "reads; 'f32': an all-F32 conversion of it, the bytes transformers reads)")
    p.add_argument("--no-install", action="store_true", help="do not npm install node-llama-cpp (skip if missing)")
    p.add_argument("--no-engine", action="store_true", help="leave out the in-process kvserve engine row")

    p = sub.add_parser("llama-server", parents=[common],
                       help="kvserve vs llama.cpp's own server: single stream at ~50/~1000 ctx, 4/8/16 streams")
    p.add_argument("--contexts", type=int, nargs="+", help="single-stream prompt lengths (default 50 1000)")
    p.add_argument("--concurrency", type=int, nargs="+", help="concurrent streams (default 4 8 16)")
    p.add_argument("--output-len", type=int, help="output tokens per request (default 128; quick 32)")
    p.add_argument("--stream-prompt-len", type=int, help="prompt tokens of the concurrent streams (default 50)")
    p.add_argument("--single-requests", type=int, help="single-stream requests per context (default 3; quick 1)")
    p.add_argument("--waves", type=int, help="concurrent requests = waves x concurrency (default 2; quick 1)")
    p.add_argument("--rounds", type=int, help="llama-server: measure each workload this many times on fresh prompts, "
                                              "alternating which server goes first; ratio = median of the rounds' "
                                              "(default 3, issue 39's medians of 3 rounds; quick 1)")
    p.add_argument("--llama-gguf", help="the GGUF llama-server runs: default the shipped Q4_1 file; 'f32', "
                                        "'Q8_0', 'Q4_K_M', 'F16' or 'BF16' (made with llama-quantize, cached) or a path")
    p.add_argument("--no-agreement", action="store_true",
                   help="skip the teacher-forced agreement (and loading the engine and transformers in process)")
    from bench.vs_llama_server import SAME_FILE_CHOICES

    p.add_argument("--gguf", choices=SAME_FILE_CHOICES,
                   help="one file on both sides: the shipped Q4_1, SmolLM2 re-quantized by llama-quantize (Q4_K_M, "
                        "Q8_0; made and cached) or the 1B-shaped random Q4_K_M (bench.make_gguf); sets --llama-gguf "
                        "and kvserve's --model (the random 1B also turns the agreement off)")

    p = sub.add_parser("kv-cache", parents=[common], help="TTFT/TPOT and per-token cost with vs without a KV cache")
    p.add_argument("--new-tokens", type=int, help="default 32; quick 8")
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 8 16 ... 1024; quick up to 256)")
    p.add_argument("--repeats", type=int, help="best of N (default 3; quick 2)")

    p = sub.add_parser("prefix", parents=[common], help="TTFT with a shared 1,000-token system prompt: miss vs hit")
    p.add_argument("--system-tokens", type=int, help="default 1000")
    p.add_argument("--rounds", type=int, help="miss/hit pairs (default 6; quick 2)")

    p = sub.add_parser("structured", parents=[common],
                       help="constrained (JSON schema) vs free decoding at 16 streams; grammar compiles off the step")
    p.add_argument("--concurrency", type=int, help="streams (default 16)")
    p.add_argument("--output-len", type=int, help="output tokens (default 48; quick 24)")
    p.add_argument("--rounds", type=int, help="rounds of both sides (default 2; quick 1)")
    p.add_argument("--inject", type=int, help="requests with a fresh schema in the stall test (default 8; quick 4)")
    p.add_argument("--gap-rounds", type=int,
                   help="stall-test rounds, fresh and cached alternating (default 3; quick 1)")

    p = sub.add_parser("kv-memory", parents=[common], help="KV slot utilization and concurrency in a fixed budget")
    p.add_argument("--max-model-len", type=int, help="default 2048; quick 1024")
    p.add_argument("--budget-tokens", type=int, help="KV pool in token slots (default 4 x max-model-len)")
    p.add_argument("--requests", type=int, help="default 48; quick 24")
    p.add_argument("--prompt-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 64 512; quick 96 384")
    p.add_argument("--output-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default 16 128; quick 8 32")

    p = sub.add_parser("kv-tier", parents=[common],
                       help="TTFT of a long prefix restored from the disk tier (evicted; after a restart) vs a miss")
    p.add_argument("--prefix-tokens", type=int, help="default 2000")
    p.add_argument("--rounds", type=int, help="miss/hit pairs (default 3; quick 1)")
    p.add_argument("--tensor-parallel-size", type=int, help="ranks the model is split over (default 1; SmolLM2: 1 or 3)")

    p = sub.add_parser("roofline", parents=[common], help="matmul GFLOP/s, memory bandwidth, kvserve against both; "
                                                          "the decode step's roofline and breakdown at 1/4/8/16 rows")
    p.add_argument("--new-tokens", type=int, help="default 32; quick 16")
    p.add_argument("--single-requests", type=int, help="default 2; quick 1")
    p.add_argument("--batch-size", type=int, help="default 32; quick 16")
    p.add_argument("--matmul-n", type=int, help="default 2048; quick 1024")
    p.add_argument("--bandwidth-mib", type=int, help="default 1024; quick 512")
    p.add_argument("--rows", type=int, nargs="+", help="decode step breakdown at these row counts (default 1 4 8 16; "
                                                       "the step check is on the largest)")
    p.add_argument("--step-tokens", type=int, help="tokens per request of the breakdown's rounds (default 64; quick 16)")
    p.add_argument("--gguf", help="the model measured, at the CPU defaults: the default model (the shipped Q4_1), "
                                  f"one of {', '.join(SAME_FILE_CHOICES[1:])} (as llama-server --gguf: made and "
                                  "cached on first use) or a .gguf path")

    p = sub.add_parser("all", parents=[common], help="every scenario, then the PASS/FAIL summary")
    p.add_argument("--skip", help="comma list of scenarios to leave out")
    p.add_argument("--peers", help="comma list of hf, hf-cb, llamacpp (default: all)")
    p.add_argument("--no-install", action="store_true", help="do not npm install node-llama-cpp (skip if missing)")
    p.add_argument("--no-engine", action="store_true", help="leave out the in-process kvserve engine row of peers")
    p.add_argument("--benchmarks-md", help="also write this Markdown report (e.g. BENCHMARKS.md)")
    p.add_argument("--plots-dir", default="docs/bench",
                   help="where --benchmarks-md copies the plots (default %(default)s)")

    p = sub.add_parser("report", help="rewrite the Markdown report from the last `all` run's JSON files")
    p.add_argument("--output-dir", default=str(RESULTS_DIR), help="the `all` run's output dir (default %(default)s)")
    p.add_argument("--benchmarks-md", default="BENCHMARKS.md", help="default %(default)s")
    p.add_argument("--plots-dir", default="docs/bench", help="default %(default)s")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `kvserve bench` execs `python -m bench` and names itself here, for --help and the run record
    prog = prog or os.environ.get("KVSERVE_BENCH_PROG") or "python -m bench"
    args = build_parser(prog).parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.scenario == "report":
        rebuild_report(args)
        return 0
    if args.scenario == "all":
        results = run_all(args, argv, prog)
        return 1 if any("error" in r for r in results) else 0
    if args.scenario == "llama-server" and args.gguf:
        from bench.vs_llama_server import same_file_args

        args.llama_gguf, args.serve_arg, keep_agreement = same_file_args(args.gguf, args.serve_arg)
        args.no_agreement = args.no_agreement or not keep_agreement
    ctx = Context(args)
    try:
        result = run_one(args.scenario, ctx)
    finally:
        ctx.close()
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
