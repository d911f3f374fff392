"""Scenario ``serve-load``: the HTTP server under load at several concurrency levels.

Synthetic prompts of a set length (token ids through ``/v1/completions``; the first
``shared_prefix`` ids are the same in every prompt, like a system prompt, the rest random),
a set number of output tokens (``ignore_eos``), streamed. Each level gets its own prompts (so
no level hits the cache on the previous level's prompts) and runs ``requests_for(c)``
requests at concurrency ``c``, closed loop. Per level: output tokens/s, requests/s, TTFT and
TPOT p50/p90/p99, and the prefix-cache hit rate from ``/metrics`` deltas
(``kvserve_prefix_cache_hits_total`` / ``kvserve_prefix_cache_queries_total``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from bench.client import completion_request, prefix_hit_rate, run_load, scrape_metrics, summarize
from bench.machine import LoadMonitor, machine_info
from bench.report import Progress, finish_axes, info, new_figure, save_figure, table
from bench.server import Server
from bench.workload import synthetic_requests

DEFAULT_LEVELS = (1, 4, 16, 32)


def default_requests_for(quick: bool) -> Callable[[int], int]:
    return (lambda c: max(2, c)) if quick else (lambda c: max(4, 2 * c))


def run_serve_load(server: Server, vocab_size: int, levels: Sequence[int] = DEFAULT_LEVELS, prompt_len: int = 192,
                   output_len: int = 64, shared_prefix: int = 64, requests_for: Callable[[int], int] | None = None,
                   seed: int = 0, progress: bool = True, out_dir: Path | None = None,
                   warmup: bool = True) -> dict[str, Any]:
    requests_for = requests_for or default_requests_for(False)
    if warmup:  # first-request costs (allocator, kernel selection) stay out of level 1
        warm = synthetic_requests(2, min(prompt_len, 32), 4, vocab_size, seed=10_007)
        run_load(server, [completion_request(r.prompt_token_ids, r.output_len) for r in warm], 2)
    rows_out: list[dict[str, Any]] = []
    for level_index, c in enumerate(levels):
        reqs = synthetic_requests(requests_for(c), prompt_len, output_len, vocab_size, seed=seed * 1000 + level_index,
                                  shared_prefix=shared_prefix)
        before = scrape_metrics(server)
        with Progress(len(reqs), f"serve-load c={c}", progress) as bar, LoadMonitor([server.pid]) as mon:
            records, elapsed = run_load(server, [completion_request(r.prompt_token_ids, r.output_len) for r in reqs],
                                        c, bar)
        after = scrape_metrics(server)
        row = {"concurrency": c, **summarize(records, elapsed), **prefix_hit_rate(before, after),
               "foreign_cpu_cores": mon.foreign_cores}
        row["client_cached_fraction"] = (round(row["cached_tokens"] / row["prompt_tokens"], 4)
                                         if row["prompt_tokens"] else None)
        rows_out.append(row)

    result: dict[str, Any] = {
        "scenario": "serve-load", "title": "Serving load (HTTP, streaming)",
        "server": {"url": server.url, "kind": server.kind, "model": server.model},
        "workload": {"prompt_len": prompt_len, "shared_prefix": shared_prefix, "output_len": output_len,
                     "levels": list(levels), "requests": {str(c): requests_for(c) for c in levels}},
        "levels": rows_out,
        "notes": [f"{server.kind} server ({server.model}); prompts of {prompt_len} token ids "
                  f"({shared_prefix} shared by all, like a system prompt), {output_len} output tokens each "
                  "(ignore_eos), streamed through /v1/completions; closed loop at each concurrency. "
                  "TPOT = (last token - first token) / (tokens - 1). Hit rate from /metrics deltas. "
                  "'other procs': CPU that processes other than the bench and its server used meanwhile."],
    }
    result["tables"] = [table("serve-load: throughput and latency per concurrency",
                              ["concurrency", "requests", "errors", "output tok/s", "req/s", "TTFT p50 ms",
                               "TTFT p90 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms",
                               "prefix hit rate", "other procs (cores)"],
                              [[r["concurrency"], r["requests"], r["errors"], r["output_tps"], r["req_per_s"],
                                r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"],
                                r["tpot_p90_ms"], r["tpot_p99_ms"],
                                None if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}%",
                                r["foreign_cpu_cores"]]
                               for r in rows_out])]
    best = max(rows_out, key=lambda r: r["output_tps"] or 0)
    expected = (shared_prefix // 16 * 16) / prompt_len if prompt_len else 0
    result["checks"] = [
        info("serve-load peak output tokens/s", best["output_tps"], f"at concurrency {best['concurrency']}"),
        info("serve-load errors", sum(r["errors"] for r in rows_out),
             next((f"first: {r['first_error']}" for r in rows_out if r["first_error"]), "")),
        info("serve-load prefix hit rate (all levels)",
             _overall_rate(rows_out), f"(upper bound from the shared prefix ~{expected:.0%} at block size 16)"),
    ]
    result["plots"] = _plot(rows_out, out_dir) if out_dir else []
    result["machine"] = machine_info()
    return result


def _overall_rate(rows: list[dict[str, Any]]) -> float | None:
    hits = [r["prefix_cache_hits"] for r in rows if r["prefix_cache_hits"] is not None]
    queries = [r["prefix_cache_queries"] for r in rows if r["prefix_cache_queries"] is not None]
    return round(sum(hits) / sum(queries), 4) if queries and sum(queries) else None


def _plot(rows: list[dict[str, Any]], out_dir: Path) -> list[str]:
    fig, axes = new_figure(2, 5.0, 3.6)
    if fig is None:
        return []
    cs = [r["concurrency"] for r in rows]
    ax = axes[0]
    ax.plot(cs, [r["output_tps"] or 0 for r in rows], "o-", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    finish_axes(ax, "throughput", "concurrency", "output tokens/s", legend=False)
    ax = axes[1]
    for key, style in (("ttft", "o-"), ("tpot", "s-")):
        for q, alpha in (("p50", 1.0), ("p99", 0.5)):
            ax.plot(cs, [r[f"{key}_{q}_ms"] or float("nan") for r in rows], style, alpha=alpha,
                    label=f"{key.upper()} {q}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cs, [str(c) for c in cs])
    finish_axes(ax, "latency", "concurrency", "ms")
    return [save_figure(fig, out_dir / "serve-load.png")]
