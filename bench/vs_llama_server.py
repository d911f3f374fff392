"""Scenario ``llama-server``: kvserve's HTTP server against llama.cpp's own server, same client.

Both servers get the same requests through the same client (``bench.client.run_load``:
streamed ``/v1/completions`` with token-id prompts, ``temperature 0``, ``ignore_eos`` so that
both generate exactly ``output_len`` tokens, usage from the final SSE chunk):

* single stream at each of ``contexts`` prompt lengths (default ~50 and ~1000 tokens):
  ``single_requests`` requests one after the other; the figure is decode tokens/s of one
  stream = 1 / mean TPOT (TTFT beside it). llama-server runs with one slot.
* ``levels`` concurrent streams (default 4, 8, 16) of ``stream_prompt_len``-token prompts:
  ``waves`` x c requests, closed loop at concurrency c; the figure is output tokens/s over the
  run (prefill included). llama-server runs with ``max(levels)`` slots.

Each measurement runs kvserve, then llama-server, back to back; with ``rounds`` > 1 it is repeated on
fresh prompts, the order alternating (kvserve first, then llama-server first, ...), so that a drift
in the machine's speed between two runs hits both sides alike. The ratio is the median of the
rounds' ratios (each round's two runs are adjacent in time); each side's row shows its median run
(by the measured figure). On a shared 2-core machine the same command's single-run ratio moved by
~20% from one run to the next. llama-server runs on
``gguf`` (default: the shipped Q4_1 file, the blocks kvserve's decode matmuls read) with
``-t threads``. Every row states the weight format and the weight bytes a decode token reads
(computed from the GGUF's tensor sizes and kvserve's loaded model, not written down).

The sanity check is teacher-forced top-1 agreement over a fixed text (``bench.agreement``):
llama-server's arg-max after every prefix against transformers' (fp32) and kvserve's.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.agreement import AGREEMENT_TARGET, AGREEMENT_TEXT, engine_top1, per_prefix_top1, top1_agreement
from bench.client import completion_request, run_load, summarize
from bench.machine import LoadMonitor, machine_info, tree_memory_mib
from bench.peers.base import PeerUnavailable
from bench.peers.gguf_files import gguf_weights
from bench.peers.llama_server import (LlamaServerConfig, check_available, ctx_size_for, llama_server_next_token,
                                      package_version, resolve_gguf, start_llama_server)
from bench.peers.transformers import hf_top1, hf_weight_bytes_per_decode_token
from bench.report import Progress, check, info, new_figure, ratio, save_figure, table
from bench.server import Server, free_port
from bench.workload import synthetic_requests

DEFAULT_CONTEXTS = (50, 1000)
DEFAULT_LEVELS = (4, 8, 16)
# Targets, kvserve / llama-server at both sides' defaults (issue 39): single-stream decode at
# least 1.5x at ~50 tokens of context and 1.8x from ~1,000; at least 2.5x output tok/s at 4, 8 and
# 16 streams; TTFT at least 3x lower from ~1,000-token prompts (unique prompts: no cache hit).
TARGETS = {"single": 1.5, "streams": 2.5}
SINGLE_TARGETS = {1000: 1.8}  # from this many prompt tokens on
STREAM_TARGETS: dict[int, float] = {}
TTFT_TARGET, TTFT_FROM = 3.0, 1000


# ``--gguf``: one file both servers run (issue 39: "the benches use SmolLM2 re-quantized by
# llama-quantize to Q4_K_M and Q8_0 and the 1B-shaped random Q4_K_M, beside the shipped Q4_1").
SAME_FILE_CHOICES = ("Q4_1", "Q4_K_M", "Q8_0", "random-1b-Q4_K_M")


def same_file_gguf(choice: str) -> Path:
    """The GGUF of a ``SAME_FILE_CHOICES`` entry: the shipped Q4_1 file; SmolLM2 re-quantized by
    the sid tree's llama-quantize (``resolve_gguf``: made once from the all-F32 conversion, so no
    ``--allow-requantize``, and cached; ``PeerUnavailable`` without the tree); or the 1B-shaped
    random Q4_K_M (``bench.make_gguf.one_b_q4_k_m``, written once)."""
    if choice not in SAME_FILE_CHOICES:
        raise ValueError(f"--gguf must be one of {', '.join(SAME_FILE_CHOICES)}, not {choice!r}")
    if choice == "random-1b-Q4_K_M":
        from bench.make_gguf import one_b_q4_k_m

        return one_b_q4_k_m()
    return resolve_gguf(None if choice == "Q4_1" else choice)


def same_file_args(choice: str, serve_args: Sequence[str] | None) -> tuple[str, list[str], bool]:
    """(``--llama-gguf``, ``--serve-arg`` list, whether the teacher-forced agreement applies) for
    ``--gguf choice``: llama-server runs the file, kvserve serves it (``--model``; the default
    model needs none), and the agreement against transformers' SmolLM2 only means something for
    SmolLM2's own weights, so the random 1B file turns it off."""
    path = same_file_gguf(choice)
    served = [*(serve_args or [])]
    if choice != "Q4_1":
        served.append(f"--model={path}")
    if choice == "random-1b-Q4_K_M" and not any(a.startswith("--max-model-len") for a in served):
        from bench.make_gguf import ONE_B

        # the CPU profile's max_model_len (8192) is above this file's context: serving it needs its own
        served.append(f"--max-model-len={ONE_B.context}")
    return str(path), served, choice != "random-1b-Q4_K_M"


def stream_target(concurrency: int) -> float:
    return STREAM_TARGETS.get(concurrency, TARGETS["streams"])


def single_target(context: int) -> float:
    """The single-stream decode target at ``context`` prompt tokens: the largest threshold reached."""
    reached = [t for n, t in sorted(SINGLE_TARGETS.items()) if context >= n]
    return reached[-1] if reached else TARGETS["single"]


def _measure(server: Server, requests: Sequence[Any], concurrency: int, label: str, progress: bool) -> dict[str, Any]:
    payloads = [completion_request(r.prompt_token_ids, r.output_len) for r in requests]
    before = tree_memory_mib(server.pid) if server.pid else None
    with Progress(len(payloads), label, progress) as bar, LoadMonitor([server.pid]) as mon:
        recs, elapsed = run_load(server, payloads, concurrency, bar)
    s = summarize(recs, elapsed)
    if s["errors"]:
        raise RuntimeError(f"{label}: {s['errors']} request(s) failed: {s['first_error']}")
    s["foreign_cpu_cores"] = mon.foreign_cores
    # the server's resident memory (its process tree) after the run, what the run added, and the peak
    after = tree_memory_mib(server.pid) if server.pid else None
    s["rss_mib"] = after["rss"] if after else None
    s["rss_growth_mib"] = round(after["rss"] - before["rss"], 1) if after and before else None
    s["peak_rss_mib"] = after["peak"] if after else None
    return s


def _pair(kv: Server, ll: Server | None, make_requests: Callable[[int], Sequence[Any]], concurrency: int,
          name: str, progress: bool, key: str, rounds: int = 1) -> dict[str, Any]:
    """Both sides on ``make_requests(r)`` for each round r, alternating which goes first; each side's
    median run by ``key`` and (with a peer) each round's kvserve / llama-server ``key`` ratio."""
    runs: dict[str, list[dict[str, Any]]] = {"kvserve": [], "llama-server": []}
    round_ratios = []
    for r in range(rounds):
        requests = make_requests(r)
        order = [("kvserve", kv), ("llama-server", ll)]
        for side, server in order if r % 2 == 0 else order[::-1]:
            if server is not None:
                label = f"{name} {side}" + (f" (round {r + 1}/{rounds})" if rounds > 1 else "")
                runs[side].append(_measure(server, requests, concurrency, label, progress))
        if ll is not None:
            round_ratios.append(ratio(runs["kvserve"][-1][key], runs["llama-server"][-1][key]))
    out: dict[str, Any] = {"kvserve": _median_run(runs["kvserve"], key)}
    if ll is not None:
        out["llama-server"] = _median_run(runs["llama-server"], key)
        out["same_output_tokens"] = all(a["output_tokens"] == b["output_tokens"]
                                        for a, b in zip(runs["kvserve"], runs["llama-server"]))
        out["round_ratios"] = round_ratios
    return out


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return sorted(runs, key=lambda s: s[key] or 0)[(len(runs) - 1) // 2]


def _pair_ratio(pair: dict[str, Any], key: str) -> float | None:
    """The median of the rounds' ratios (one round: the plain ratio)."""
    ratios = [r for r in pair.get("round_ratios", []) if r is not None]
    if ratios:
        return round(statistics.median(ratios), 3)
    ll = pair.get("llama-server")
    return ratio(pair["kvserve"][key], ll[key]) if ll and ll[key] else None


def _warm(server: Server, vocab: int) -> None:
    warm = synthetic_requests(2, 16, 4, vocab, seed=10_009)
    run_load(server, [completion_request(r.prompt_token_ids, r.output_len) for r in warm], 1)


def run_vs_llama_server(server: Server, engine: Any, hf_model: Any, tokenizer: Any, vocab_size: int, threads: int,
                        contexts: Sequence[int] = DEFAULT_CONTEXTS, levels: Sequence[int] = DEFAULT_LEVELS,
                        output_len: int = 128, stream_prompt_len: int = 50, single_requests: int = 3,
                        waves: int = 2, gguf: str | None = None, seed: int = 0, progress: bool = True,
                        out_dir: Path | None = None, agreement: bool = True,
                        served_gguf: str | None = None, rounds: int = 1) -> dict[str, Any]:
    skipped: str | None = None
    llama_path: Path | None = None
    try:
        check_available()
        llama_path = resolve_gguf(gguf)
    except PeerUnavailable as exc:
        skipped = str(exc)
    log = (out_dir / "llama-server.log") if out_dir else None
    if skipped is not None:  # nothing to compare with: no kvserve-only minutes in `all`
        return _result(server, engine, hf_model, threads, {}, {}, None, None, skipped, contexts, levels,
                       output_len, stream_prompt_len, single_requests, waves, out_dir, served_gguf)

    _warm(server, vocab_size)
    single: dict[int, dict[str, Any]] = {}
    streams: dict[int, dict[str, Any]] = {}
    sanity: dict[str, Any] | None = None

    # ---- single stream: one slot
    ll = None
    if llama_path is not None:
        try:
            cfg = LlamaServerConfig(llama_path, free_port(), threads, parallel=1,
                                    ctx_size=ctx_size_for(1, max(contexts) + output_len + 16))
            ll = start_llama_server(cfg, log)
            _warm(ll, vocab_size)
        except PeerUnavailable as exc:
            skipped = str(exc)
    try:
        for i, ctx_len in enumerate(contexts):
            def reqs(r: int, i: int = i, ctx_len: int = ctx_len) -> Sequence[Any]:
                return synthetic_requests(single_requests, ctx_len, output_len, vocab_size,
                                          seed=seed * 1000 + 100 + i + 50_000 * r)
            single[ctx_len] = _pair(server, ll, reqs, 1, f"single ctx={ctx_len}", progress, "stream_decode_tps", rounds)
        if agreement and ll is not None and tokenizer is not None:
            sanity = _agreement(ll, engine, hf_model, tokenizer)
    finally:
        if ll is not None:
            ll.close()

    # ---- concurrent streams: max(levels) slots
    ll = None
    if llama_path is not None and skipped is None:
        try:
            cfg = LlamaServerConfig(llama_path, free_port(), threads, parallel=max(levels),
                                    ctx_size=ctx_size_for(max(levels), stream_prompt_len + output_len + 16))
            ll = start_llama_server(cfg, log)
            _warm(ll, vocab_size)
        except PeerUnavailable as exc:
            skipped = str(exc)
    try:
        for i, c in enumerate(levels):
            def reqs(r: int, i: int = i, c: int = c) -> Sequence[Any]:
                return synthetic_requests(waves * c, stream_prompt_len, output_len, vocab_size,
                                          seed=seed * 1000 + 200 + i + 50_000 * r)
            streams[c] = _pair(server, ll, reqs, c, f"streams c={c}", progress, "output_tps", rounds)
    finally:
        if ll is not None:
            ll.close()

    return _result(server, engine, hf_model, threads, single, streams, sanity, llama_path, skipped,
                   contexts, levels, output_len, stream_prompt_len, single_requests, waves, out_dir, served_gguf,
                   rounds)


def _agreement(ll: Server, engine: Any, hf_model: Any, tokenizer: Any) -> dict[str, Any]:
    ids = tokenizer(AGREEMENT_TEXT)["input_ids"]
    sides = {"llama-server": per_prefix_top1(llama_server_next_token(ll.url), ids)}
    if engine is not None:
        sides["kvserve"] = engine_top1(engine, ids)
        engine.kv_cache.reset_prefix_cache()
    if hf_model is not None:
        sides["transformers"] = hf_top1(hf_model, ids)
    pairs = {}
    for a, b in (("transformers", "llama-server"), ("kvserve", "llama-server"), ("transformers", "kvserve")):
        if a in sides and b in sides:
            agree = top1_agreement(sides[a], sides[b])
            for row in agree["first_differences"]:
                row.extend([tokenizer.decode([row[1]]), tokenizer.decode([row[2]])])
            pairs[f"{b} vs {a}"] = agree
    return {"text_tokens": len(ids), "positions": len(ids) - 1, "pairs": pairs}


def _weights(engine: Any, hf_model: Any, llama_path: Path | None,
             served_gguf: str | None = None) -> dict[str, dict[str, Any]]:
    """Format and decode bytes per side. ``served_gguf``: the GGUF the server was told to serve
    (``--serve-arg=--model=...``), whose blocks it decodes from; else the in-process ``engine``, else
    the server's default (the shipped file)."""
    from engine.loader import default_gguf_path

    out: dict[str, dict[str, Any]] = {}
    shipped = gguf_weights(Path(served_gguf) if served_gguf else default_gguf_path())
    blocks = f"{shipped['file_type']} GGUF blocks ({shipped['label'].split('(', 1)[-1]}"
    if served_gguf:
        out["kvserve"] = {"label": blocks, "decode_bytes": shipped["decode_bytes"], "path": served_gguf}
    elif engine is not None:
        model = engine.runner.model
        label = blocks if model.linear_backend == "gguf" else f"dense {str(model.norm.dtype).removeprefix('torch.')}"
        out["kvserve"] = {"label": label, "decode_bytes": model.decode_weight_bytes()}
    else:  # the server's default (linear_backend gguf on the shipped file); the same rule counts its bytes
        out["kvserve"] = {"label": f"{blocks}, the server's default", "decode_bytes": shipped["decode_bytes"]}
    if hf_model is not None:
        out["transformers"] = {"label": "dense fp32", "decode_bytes": hf_weight_bytes_per_decode_token(hf_model)}
    if llama_path is not None:
        w = gguf_weights(llama_path)
        out["llama-server"] = {"label": w["label"], "decode_bytes": w["decode_bytes"], "path": str(llama_path)}
    return out


def _mb(w: dict[str, Any] | None) -> str:
    return "-" if not w else f"{w['decode_bytes'] / 1e6:.0f}"


def _result(server: Server, engine: Any, hf_model: Any, threads: int, single: dict[int, Any],
            streams: dict[int, Any], sanity: dict[str, Any] | None, llama_path: Path | None, skipped: str | None,
            contexts: Sequence[int], levels: Sequence[int], output_len: int, stream_prompt_len: int,
            single_requests: int, waves: int, out_dir: Path | None,
            served_gguf: str | None = None, rounds: int = 1) -> dict[str, Any]:
    weights = _weights(engine, hf_model, llama_path, served_gguf)
    version = package_version()
    ratios: dict[str, Any] = {}
    checks = []
    rows = []
    for ctx_len, pair in single.items():
        k, ll = pair["kvserve"], pair.get("llama-server")
        r = _pair_ratio(pair, "stream_decode_tps")
        ratios[f"single_ctx{ctx_len}"] = r
        checks.append(check(f"single-stream decode at {ctx_len} prompt tokens, kvserve / llama-server", r,
                            single_target(ctx_len), skipped=skipped if r is None else None,
                            detail=f"kvserve {k['stream_decode_tps']} vs {ll['stream_decode_tps']} tok/s"
                                   f"{_rounds(pair)}" if ll else ""))
        if ctx_len >= TTFT_FROM:
            t = ratio(ll["ttft_p50_ms"], k["ttft_p50_ms"]) if ll and k["ttft_p50_ms"] else None
            ratios[f"ttft_ctx{ctx_len}"] = t
            checks.append(check(f"TTFT at {ctx_len} prompt tokens, llama-server / kvserve (how many times lower)", t,
                                TTFT_TARGET, skipped=skipped if t is None else None,
                                detail=f"kvserve {k['ttft_p50_ms']} vs {ll['ttft_p50_ms']} ms p50 (median runs);"
                                       f" resident MiB after the run (added by it): kvserve {_mem(k)},"
                                       f" llama-server {_mem(ll)}" if ll else ""))
        for side, s in (("kvserve", k), ("llama-server", ll)):
            if s:
                rows.append([f"single, {ctx_len} ctx", side, weights.get(side, {}).get("label", "-"),
                             _mb(weights.get(side)), s["stream_decode_tps"], s["tpot_p50_ms"], s["ttft_p50_ms"],
                             s["output_tokens"], r if side == "kvserve" else "", _mem(s),
                             _f(s.get("foreign_cpu_cores"))])
    for c, pair in streams.items():
        k, ll = pair["kvserve"], pair.get("llama-server")
        r = _pair_ratio(pair, "output_tps")
        ratios[f"streams_{c}"] = r
        checks.append(check(f"{c} concurrent streams, output tok/s, kvserve / llama-server", r, stream_target(c),
                            skipped=skipped if r is None else None,
                            detail=f"kvserve {k['output_tps']} vs {ll['output_tps']} tok/s{_rounds(pair)}" if ll else ""))
        for side, s in (("kvserve", k), ("llama-server", ll)):
            if s:
                rows.append([f"{c} streams", side, weights.get(side, {}).get("label", "-"), _mb(weights.get(side)),
                             s["output_tps"], s["tpot_p50_ms"], s["ttft_p50_ms"], s["output_tokens"],
                             r if side == "kvserve" else "", _mem(s), _f(s.get("foreign_cpu_cores"))])
    if not single and not streams:
        checks += [check(f"single-stream decode at {c} prompt tokens, kvserve / llama-server", None, single_target(c),
                         skipped=skipped) for c in contexts]
        checks += [check(f"{c} concurrent streams, output tok/s, kvserve / llama-server", None, stream_target(c),
                         skipped=skipped) for c in levels]
    mismatched = [k for k, p in [*single.items(), *streams.items()] if p.get("same_output_tokens") is False]
    if mismatched:
        checks.append(info("output token counts differ between the servers", mismatched))

    agree_rows = []
    if sanity is None:
        checks.append(info("teacher-forced top-1 agreement, llama-server vs transformers", "not run", skipped or ""))
    else:
        for name, a in sanity["pairs"].items():
            agree_rows.append([name, f"{a['agree']} / {a['positions']}", a["fraction"],
                               "; ".join(f"pos {i}: {ta!r} vs {tb!r}" for i, _, _, ta, tb in a["first_differences"])
                               or "-"])
        main = sanity["pairs"].get("llama-server vs transformers")
        if main:
            checks.append(check("teacher-forced top-1 agreement, llama-server vs transformers", main["fraction"],
                                AGREEMENT_TARGET, unit="",
                                detail=f"{main['agree']} of {main['positions']} positions of a fixed text"))
    tables = [table("llama-server: kvserve and llama.cpp's server, same client and requests",
                    ["workload", "server", "weights", "MB read / token", "tok/s", "TPOT p50 ms", "TTFT p50 ms",
                     "output tokens", "kvserve / llama-server", "resident MiB (added)", "other procs (cores)"], rows)]
    if agree_rows:
        tables.append(table("llama-server: teacher-forced top-1 agreement over a fixed text",
                            ["pair", "agree", "fraction", "first differences (reference vs candidate)"], agree_rows))
    if weights:
        tables.append(table("llama-server: weights each side reads per decode token",
                            ["side", "format", "MB / token"],
                            [[k, w["label"], _mb(w)] for k, w in weights.items()]))
    result: dict[str, Any] = {
        "scenario": "llama-server", "title": "kvserve vs llama.cpp's own server (llama-server)",
        "workload": {"contexts": list(contexts), "levels": list(levels), "output_len": output_len,
                     "stream_prompt_len": stream_prompt_len, "single_requests": single_requests, "waves": waves,
                     "rounds": rounds,
                     "threads": threads, "gguf": str(llama_path) if llama_path else None},
        "llama_server": {"package": f"llama.cpp-tools {version}" if version else None, "skipped": skipped},
        "server": {"url": server.url, "kind": server.kind, "model": server.model},
        "weights": weights, "single": single, "streams": streams, "ratios": ratios, "agreement": sanity,
        "checks": checks, "tables": tables,
        "notes": [f"Both servers get the same token-id prompts through the same streaming client (/v1/completions, "
                  f"temperature 0, ignore_eos, {output_len} output tokens, usage from the final SSE chunk). Single "
                  f"stream: {single_requests} requests one at a time at each of {list(contexts)} prompt tokens; "
                  "tok/s = 1 / mean TPOT (prefill left out), llama-server with 1 slot. Streams: "
                  f"{waves} x c requests of {stream_prompt_len} prompt tokens at concurrency c in {list(levels)}; "
                  f"tok/s = output tokens / wall time (prefill included), llama-server with {max(levels)} slots. "
                  f"{threads} threads on each side (llama-server -t/-tb). "
                  + (f"{rounds} rounds on fresh prompts, alternating which server goes first; the ratio is the "
                     "median of the rounds' ratios, each side's row its median run. " if rounds > 1 else "")
                  + "llama-server: Debian sid "
                  f"llama.cpp-tools {version or '?'} in a chroot (scripts/llama-server-peer.sh). Teacher-forced "
                  "agreement: each side's arg-max after every prefix of a fixed English text (transformers: one "
                  "fp32 forward pass; kvserve engine and llama-server: one greedy token per prefix)."]
                 + ([f"llama-server skipped: {skipped}"] if skipped else []),
    }
    result["plots"] = _plot(result, out_dir) if out_dir and (single or streams) else []
    result["machine"] = machine_info()
    return result


def _rounds(pair: dict[str, Any]) -> str:
    ratios = pair.get("round_ratios", [])
    return f" (median run); rounds: {', '.join(f'{r:.3f}x' for r in ratios if r is not None)}" if len(ratios) > 1 else ""


def _mem(s: dict[str, Any] | None) -> str:
    """A run's resident MiB after it, with what the run added: '812 (+3)'; '-' where not measured."""
    if not s or s.get("rss_mib") is None:
        return "-"
    growth = s.get("rss_growth_mib")
    return f"{s['rss_mib']:,.0f}" + (f" ({growth:+,.0f})" if growth is not None else "")


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    fig, axes = new_figure(2, 4.6, 3.4)
    if fig is None:
        return []
    for ax, (key, metric, title, fmt) in zip(axes, (("single", "stream_decode_tps", "single-stream decode",
                                                     "{} ctx"),
                                                    ("streams", "output_tps", "concurrent streams", "c={}"))):
        groups = list(result[key].items())
        width = 0.38
        for j, (side, color) in enumerate((("kvserve", "#2a7"), ("llama-server", "#888"))):
            xs = [i + (j - 0.5) * width for i in range(len(groups))]
            vals = [(p.get(side) or {}).get(metric) or 0 for _, p in groups]
            bars = ax.bar(xs, vals, width, color=color, label=side)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(groups)), [fmt.format(g) for g, _ in groups])
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return [save_figure(fig, out_dir / "llama-server.png")]
