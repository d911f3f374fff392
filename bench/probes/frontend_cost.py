"""The frontend's CPU per streamed token: ``/proc`` CPU time (user + system) of the server process
alone, while the engine core runs in its own process, over streamed greedy completions.

    python -m bench.probes.frontend_cost [--checkout DIR ...] [--streams 1 16] [--tokens 128]
                                         [--rounds 3] [--serve-arg=--activation-quant=int8 ...]

One ``kvserve serve`` subprocess per checkout (default: this one; several compare code versions,
e.g. a branch against main), all started first, then measured in turn within each round, so a
shared machine's load falls on each side alike. Per round and stream count each server streams
``streams`` concurrent requests of ``tokens`` tokens each (distinct token-id prompts, ignore_eos,
``include_usage``); the server process's CPU time over that run (``/proc/PID/stat`` utime +
stime, or the threads' schedstat in nanoseconds: the frontend's threads, not the core, a child
process whose time is not counted there while it runs), less the server's idle CPU rate measured
for 2 s just before times the run's length, divided by the streamed tokens. Prints each round and the median per checkout.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.client import completion_request, run_load
from bench.peers.base import free_port, launch
from bench.server import REPO_ROOT, Server

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` itself (all its threads, no children): the sum of its live
    threads' ``schedstat`` run times (nanoseconds), else ``stat``'s utime + stime (clock ticks)."""
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15 of stat)


def idle_rate(pid: int, seconds: float = 2.0) -> float:
    """CPU seconds per second the server spends with nothing to serve (its timers and polls)."""
    before = process_cpu_s(pid)
    time.sleep(seconds)
    return (process_cpu_s(pid) - before) / seconds


def start(checkout: Path, serve_args: list[str], log: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--shutdown-grace", "2", *serve_args]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    env.pop("KVSERVE_API_KEY", None)
    return launch(cmd, f"http://127.0.0.1:{port}", "subprocess", log, 600.0, cwd=checkout, env=env)


def measure(server: Server, streams: int, tokens: int, seed: int) -> dict[str, Any]:
    """One run: the server's CPU per streamed token, raw and net of its idle rate (measured just
    before, so that on a slow, shared machine the timers' CPU is not counted as the tokens')."""
    requests = [completion_request([100 + (seed * 97 + s * 31 + i) % 4000 for i in range(32)], tokens)
                for s in range(streams)]
    idle = idle_rate(server.pid)
    before = process_cpu_s(server.pid)
    records, elapsed = run_load(server, requests, streams)
    cpu = process_cpu_s(server.pid) - before
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    streamed = sum(r.output_tokens for r in records)
    return {"ms_per_token": 1e3 * (cpu - idle * elapsed) / streamed, "raw_ms_per_token": 1e3 * cpu / streamed,
            "cpu_s": cpu, "idle_cpu_s": idle * elapsed, "tokens": streamed, "tok_s": streamed / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", type=Path, default=None,
                        help="a kvserve source tree to serve from (repeat to compare; default: this one)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra argument of kvserve serve")
    parser.add_argument("--log", type=Path, default=REPO_ROOT / "bench" / "results" / "frontend_cost.log",
                        help="the servers' output (appended)")
    args = parser.parse_args()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    checkouts = [c.resolve() for c in (args.checkout or [REPO_ROOT])]
    serve_args = ["--num-threads", str(args.num_threads), "--max-model-len", "1024", *args.serve_arg]
    servers = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers are closed on the way out
    try:
        for c in checkouts:
            servers[c] = start(c, serve_args, args.log)
            measure(servers[c], 2, 16, seed=999)  # warm-up: first requests pay one-off costs
        results: dict[tuple[Path, int], list[float]] = {}
        for r in range(args.rounds):
            for streams in args.streams:
                for c in (checkouts if r % 2 == 0 else checkouts[::-1]):
                    m = measure(servers[c], streams, args.tokens, seed=r * 10 + streams)
                    results.setdefault((c, streams), []).append(m["ms_per_token"])
                    print(f"round {r + 1} {c.name:>14} {streams:3d} streams: {m['ms_per_token']:.3f} ms CPU/token net "
                          f"of idle ({m['raw_ms_per_token']:.3f} raw: {m['cpu_s']:.3f} s, {m['idle_cpu_s']:.3f} s of it "
                          f"the idle rate, over {m['tokens']} tokens, {m['tok_s']:.0f} tok/s)", flush=True)
        print(f"frontend CPU per streamed token, median of {args.rounds} rounds (serve args: {' '.join(serve_args)}):")
        for streams in args.streams:
            row = ", ".join(f"{c.name} {statistics.median(results[c, streams]):.3f} ms" for c in checkouts)
            print(f"  {streams:3d} streams: {row}")
    finally:
        for s in servers.values():
            s.close()


if __name__ == "__main__":
    main()
