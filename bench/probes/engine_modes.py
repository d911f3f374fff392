"""``serve-load`` against two servers side by side: the engine core in its own process (the served
default) and in a thread of the server process (``--engine-mode thread``, the old layout).

    python -m bench.probes.engine_modes [--concurrency 1 32] [--rounds 1] [--quick] [--py-spy SECONDS]

Each side is a fresh ``kvserve serve`` subprocess (the composition root), run alone, one after
the other (order alternates between rounds: process, thread, thread, process, ...), after an
untimed warm-up server. Prints
output tokens/s and TTFT p50 per concurrency, the process/thread ratio, and writes the rows to
``bench/results/engine_modes.json``. ``--py-spy SECONDS`` samples the process-mode server's
frontend process (every thread: event loop, tokenizer worker, sender, supervisor) with py-spy
(a dev tool, ``pip install py-spy``; not a dependency) during its load and prints where its CPU
time goes, by function (self time) and by thread.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.serve_load import run_serve_load
from bench.server import start_subprocess

RESULTS = Path(__file__).parent / "results"
VOCAB = 49152  # SmolLM2


def run_side(mode: str, levels: list[int], args: argparse.Namespace, log: Path, spy_out: Path | None) -> dict:
    serve_args = ["--engine-mode", mode, "--num-threads", str(args.num_threads), "--max-model-len", "1024"]
    server = start_subprocess(serve_args, log_path=log)
    spy = None
    if spy_out is not None:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--duration", str(args.py_spy),
                                "--format", "raw", "--threads", "--nonblocking", "-o", str(spy_out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        quick = args.quick
        return run_serve_load(server, VOCAB, levels=levels, prompt_len=96 if quick else 192,
                              output_len=16 if quick else 64, shared_prefix=32 if quick else 64,
                              requests_for=(lambda c: max(2, c)) if quick else (lambda c: max(4, 2 * c)),
                              progress=False)
    finally:
        if spy is not None:
            spy.wait(args.py_spy + 60)
        server.close()


def summarize_spy(path: Path, top: int = 20) -> None:
    """Self samples by function and samples by thread, from py-spy's collapsed-stack output."""
    by_func: collections.Counter = collections.Counter()
    by_thread: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        by_thread[frames[0]] += n
        by_func[frames[-1]] += n
    print(f"\nfrontend process, {total} samples (100 Hz, busy threads only):")
    for name, n in by_thread.most_common(8):
        print(f"  {100 * n / total:5.1f}%  {name}")
    print("self time by function:")
    for name, n in by_func.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.engine_modes", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--py-spy", type=int, metavar="SECONDS", help="sample the process-mode frontend this long")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {"process": [], "thread": []}
    # The first server of a run is measured slower (cold page cache and CPU caches, ~10% at one
    # stream): an untimed warm-up side keeps that off whichever mode would go first.
    run_side("thread", [1], argparse.Namespace(**{**vars(args), "quick": True}), RESULTS / "engine_modes_warmup.log",
             None)
    for r in range(args.rounds):
        order = ("process", "thread") if r % 2 == 0 else ("thread", "process")
        for mode in order:
            spy = RESULTS / "frontend.pyspy.txt" if (args.py_spy and mode == "process" and r == 0) else None
            if spy is not None and shutil.which("py-spy") is None:
                sys.exit("--py-spy needs py-spy on PATH (pip install py-spy)")
            result = run_side(mode, args.concurrency, args, RESULTS / f"engine_modes_{mode}.log", spy)
            rows[mode] += result["levels"]
    print(f"{'c':>4} {'mode':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'other procs':>12}")
    summary = []
    for c in args.concurrency:
        per = {}
        for mode in ("process", "thread"):
            levels = [x for x in rows[mode] if x["concurrency"] == c]
            tps = sum(x["output_tps"] for x in levels) / len(levels)
            ttft = sorted(x["ttft_p50_ms"] for x in levels)[len(levels) // 2]
            tpot = sorted(x["tpot_p50_ms"] for x in levels)[len(levels) // 2]
            foreign = max((x.get("foreign_cpu_cores") or 0) for x in levels)
            per[mode] = {"output_tps": tps, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot, "foreign_cpu_cores": foreign}
            print(f"{c:>4} {mode:>8} {tps:>10.1f} {ttft:>12.1f} {tpot:>12.1f} {foreign:>12.2f}")
        ratio = per["process"]["output_tps"] / per["thread"]["output_tps"]
        print(f"{c:>4} process/thread output tok/s: {ratio:.3f}x; TTFT p50 {per['process']['ttft_p50_ms']:.1f} vs "
              f"{per['thread']['ttft_p50_ms']:.1f} ms")
        summary.append({"concurrency": c, **{f"{m}_{k}": v for m in per for k, v in per[m].items()},
                        "tps_ratio": ratio})
    (RESULTS / "engine_modes.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    if args.py_spy and (RESULTS / "frontend.pyspy.txt").exists():
        summarize_spy(RESULTS / "frontend.pyspy.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
