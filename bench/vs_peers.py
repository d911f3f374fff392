"""Scenario ``peers``: kvserve against the tools a user would pick instead, on the same requests.

Two workloads of synthetic token-id prompts (set prompt and output lengths, EOS ignored so
every side generates exactly the same number of tokens):

* single stream: ``single_requests`` requests one after the other; decode tokens/s =
  (tokens - 1) / (last token - first token), so prefill is left out; TTFT next to it;
* batch: ``batch_size`` x ``batch_waves`` requests; kvserve at concurrency ``batch_size``,
  output tokens/s over the whole run, prefill included.

Sides: kvserve through its HTTP server (streaming; the client's cost is on kvserve's side);
transformers ``generate`` on the same dense fp32 weights (single stream, and static batches of
``batch_size``, left-padded); transformers' continuous batching (the manager behind
``generate_batch``, ``bench.peers.transformers``; batch only); llama.cpp through the npm
package node-llama-cpp on the shipped Q4_1 GGUF itself: the same weights in the same bytes
kvserve's decode matmuls read (``linear_backend: gguf``); ``--gguf f32`` runs it on an all-F32
conversion instead, the bytes transformers reads (``bench.peers.node_llama_cpp``; one sequence, then
``batch_size`` parallel sequences). Sides run back to back, single stream
first, so that machine drift spreads over all of them. A side that cannot be installed or run
is reported as skipped with the reason. Every row states the weight format it runs and the
weight bytes one decode token reads (from the GGUF's tensor sizes / the loaded models).

The llama.cpp sanity check is teacher-forced top-1 agreement over a fixed text
(``bench.agreement``; target 95%), not greedy text equality: llama.cpp quantizes activations
to 8 bits for its Q4_1 dot products, so one near-tie can send its greedy text elsewhere for
good while its next-token choices agree almost everywhere.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.agreement import AGREEMENT_TARGET, AGREEMENT_TEXT, engine_top1, prefixes, top1_agreement
from bench.client import completion_request, run_load, summarize
from bench.engine_runs import kvserve_single, run_kvserve
from bench.machine import LoadMonitor, machine_info, wait_for_quiet
from bench.peers import node_llama_cpp
from bench.peers.base import PeerUnavailable
from bench.peers.gguf_files import f32_gguf, gguf_weights
from bench.peers.node_llama_cpp import run_llamacpp
from bench.peers.transformers import (hf_single, hf_top1, hf_weight_bytes_per_decode_token, run_hf_continuous,
                                      run_hf_static)
from bench.report import Progress, check, info, new_figure, ratio, save_figure, table
from bench.server import Server
from bench.workload import BenchRequest, synthetic_requests
from engine.loader import default_gguf_path

ALL_PEERS = ("hf", "hf-cb", "llamacpp")
SIDES = {"kvserve": "kvserve (HTTP server)", "kvserve-engine": "kvserve engine (in process)",
         "hf": "transformers generate",
         "hf-cb": "transformers continuous batching", "llamacpp": "llama.cpp (node-llama-cpp)"}
TARGETS = {("single", "hf"): 1.5, ("single", "llamacpp"): 0.9,
           ("batch", "hf"): 2.0, ("batch", "hf-cb"): 1.5, ("batch", "llamacpp"): 3.0}


def _skip(exc: BaseException) -> dict[str, Any]:
    reason = str(exc) if isinstance(exc, PeerUnavailable) else f"{type(exc).__name__}: {exc}"
    return {"skipped": reason, "traceback": traceback.format_exc(limit=3)}


def _kvserve_single(server: Server, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    recs, elapsed = run_load(server, [completion_request(r.prompt_token_ids, r.output_len) for r in requests], 1)
    s = summarize(recs, elapsed)
    if s["errors"]:
        raise RuntimeError(f"kvserve request failed: {s['first_error']}")
    return {"decode_tps": s["stream_decode_tps"], "ttft_ms": s["ttft_p50_ms"], "output_tokens": s["output_tokens"]}


def _kvserve_batch(server: Server, requests: Sequence[BenchRequest], concurrency: int,
                   progress: bool) -> dict[str, Any]:
    with Progress(len(requests), f"peers kvserve c={concurrency}", progress) as bar:
        recs, elapsed = run_load(server, [completion_request(r.prompt_token_ids, r.output_len) for r in requests],
                                 concurrency, bar)
    s = summarize(recs, elapsed)
    if s["errors"]:
        raise RuntimeError(f"kvserve request failed: {s['first_error']}")
    return {"tps": s["output_tps"], "elapsed_s": s["elapsed_s"], "output_tokens": s["output_tokens"],
            "ttft_p50_ms": s["ttft_p50_ms"], "tpot_p50_ms": s["tpot_p50_ms"]}


def _engine_single(engine: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    runs = [kvserve_single(engine, r.prompt_token_ids, r.output_len) for r in requests]
    engine.kv_cache.reset_prefix_cache()
    return {"decode_tps": round(sum(len(x["tokens"]) - 1 for x in runs) / sum(x["decode_s"] for x in runs), 3),
            "ttft_ms": round(1000 * sorted(x["ttft_s"] for x in runs)[len(runs) // 2], 2),
            "output_tokens": sum(len(x["tokens"]) for x in runs)}


def _engine_batch(engine: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    out = run_kvserve(engine, requests)  # the in-process engine client, every request submitted at once
    engine.kv_cache.reset_prefix_cache()
    return {"tps": round(out["output_tokens"] / out["elapsed_s"], 3), "elapsed_s": round(out["elapsed_s"], 3),
            "output_tokens": out["output_tokens"]}


def _hf_single(model: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    runs = [hf_single(model, r.prompt_token_ids, r.output_len) for r in requests]
    return {"decode_tps": round(sum(len(x["tokens"]) - 1 for x in runs) / sum(x["decode_s"] for x in runs), 3),
            "ttft_ms": round(1000 * sorted(x["ttft_s"] for x in runs)[len(runs) // 2], 2),
            "output_tokens": sum(len(x["tokens"]) for x in runs)}


class _Timer:
    """Runs one side after (optionally) waiting for a quiet CPU; records other processes' load."""

    def __init__(self, server: Server, quiet_wait_s: float) -> None:
        self.server, self.quiet_wait_s = server, quiet_wait_s

    def __call__(self, fn: Any, *args: Any) -> dict[str, Any]:
        if self.quiet_wait_s > 0:
            wait_for_quiet(self.quiet_wait_s)
        with LoadMonitor([self.server.pid]) as mon:
            out = fn(*args)
        out["foreign_cpu_cores"] = mon.foreign_cores
        return out


def teacher_forced_sanity(tokenizer: Any, gguf: Path, threads: int, hf_model: Any = None, engine: Any = None,
                          install: bool = True, text: str = AGREEMENT_TEXT) -> dict[str, Any]:
    """llama.cpp's arg-max after every prefix of ``text`` (one greedy token per prefix,
    node-llama-cpp) against transformers' (one fp32 forward pass) and kvserve's engine."""
    ids = tokenizer(text)["input_ids"]
    out = run_llamacpp(gguf, [BenchRequest(p, 1) for p in prefixes(ids)], parallel=1, threads=threads,
                       install=install)
    sides = {"llama.cpp": [int(r["tokens"][0]) for r in out["requests"]]}
    if hf_model is not None:
        sides["transformers"] = hf_top1(hf_model, ids)
    if engine is not None:
        sides["kvserve"] = engine_top1(engine, ids)
        engine.kv_cache.reset_prefix_cache()
    pairs = {}
    for ref in ("transformers", "kvserve"):
        if ref in sides:
            a = top1_agreement(sides[ref], sides["llama.cpp"])
            for row in a["first_differences"]:
                row.extend([tokenizer.decode([row[1]]), tokenizer.decode([row[2]])])
            pairs[f"llama.cpp vs {ref}"] = a
    return {"positions": len(ids) - 1, "pairs": pairs}


def side_weights(engine: Any, hf_model: Any, llama_path: Path | None) -> dict[str, dict[str, Any]]:
    """The weight format each side runs and the bytes one decode token reads (None: unknown)."""
    from engine.loader import default_gguf_path

    shipped = gguf_weights(default_gguf_path())
    if engine is not None:
        model = engine.runner.model
        kv = {"label": f"Q4_1 GGUF blocks ({shipped['label'].split('(', 1)[-1]}" if model.linear_backend == "gguf"
              else "dense fp32 (from the Q4_1 GGUF)", "decode_bytes": model.decode_weight_bytes()}
    else:
        kv = {"label": "the server's (default: Q4_1 GGUF blocks)", "decode_bytes": shipped["decode_bytes"]}
    out = {"kvserve": kv, "kvserve-engine": kv}
    if hf_model is not None:
        hf = {"label": "dense fp32", "decode_bytes": hf_weight_bytes_per_decode_token(hf_model)}
        out["hf"] = out["hf-cb"] = hf
    if llama_path is not None and Path(llama_path).exists():
        w = gguf_weights(llama_path)
        out["llamacpp"] = {"label": w["label"], "decode_bytes": w["decode_bytes"]}
    return out


def run_peers(server: Server, hf_model: Any, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
              threads: int, peers: Sequence[str] = ALL_PEERS, prompt_len: int = 128, output_len: int = 64,
              single_requests: int = 2, batch_size: int = 32, batch_waves: int = 1, seed: int = 7,
              gguf: Path | str | None = None, install: bool = True, progress: bool = True,
              out_dir: Path | None = None, quiet_wait_s: float = 0.0, engine: Any = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    _timed = _Timer(server, quiet_wait_s)
    single = synthetic_requests(single_requests, prompt_len, output_len, vocab_size, seed=seed * 1000 + 1)
    batch = synthetic_requests(batch_size * batch_waves, prompt_len, output_len, vocab_size, seed=seed * 1000 + 2)
    own = ("kvserve", "kvserve-engine") if engine is not None else ("kvserve",)
    sides: dict[str, dict[str, Any]] = {k: {} for k in (*own, *peers)}
    sanity: dict[str, Any] | None = None

    llama_path: Path | None = None
    if "llamacpp" in peers:
        try:
            llama_path = f32_gguf() if str(gguf) == "f32" else Path(gguf) if gguf else default_gguf_path()
        except Exception as exc:  # noqa: BLE001 - reported as skipped
            sides["llamacpp"] = {"single": _skip(exc), "batch": _skip(exc)}

    # warm-up of the in-process peers (the server was warmed by serve-load or gets it here)
    warm = synthetic_requests(1, 16, 4, vocab_size, seed=99)
    run_load(server, [completion_request(warm[0].prompt_token_ids, 4)], 1)
    if "hf" in peers or "hf-cb" in peers:
        hf_single(hf_model, warm[0].prompt_token_ids, 4)
    if engine is not None:
        kvserve_single(engine, warm[0].prompt_token_ids, 4)

    # ---- single stream, back to back
    sides["kvserve"]["single"] = _timed(_kvserve_single, server, single)
    if engine is not None:
        sides["kvserve-engine"]["single"] = _timed(_engine_single, engine, single)
    if "hf" in peers:
        try:
            sides["hf"]["single"] = _timed(_hf_single, hf_model, single)
        except Exception as exc:  # noqa: BLE001
            sides["hf"]["single"] = _skip(exc)
    if "hf-cb" in peers:
        sides["hf-cb"]["single"] = {"skipped": "not measured: continuous batching is a batch peer"}
    if llama_path is not None:
        try:
            sides["llamacpp"]["single"] = _timed(node_llama_cpp.run_single, llama_path, single, threads, install)
        except Exception as exc:  # noqa: BLE001
            sides["llamacpp"]["single"] = _skip(exc)

    # ---- batch, back to back
    sides["kvserve"]["batch"] = _timed(_kvserve_batch, server, batch, batch_size, progress)
    if engine is not None:
        sides["kvserve-engine"]["batch"] = _timed(_engine_batch, engine, batch)
    if "hf" in peers:
        try:
            out = _timed(run_hf_static, hf_model, batch, batch_size)
            out["tps"] = round(out["output_tokens"] / out["elapsed_s"], 3)
            sides["hf"]["batch"] = out
        except Exception as exc:  # noqa: BLE001
            sides["hf"]["batch"] = _skip(exc)
    if "hf-cb" in peers:
        try:
            out = _timed(run_hf_continuous, hf_model, batch)
            out["tps"] = round(out["output_tokens"] / out["elapsed_s"], 3)
            sides["hf-cb"]["batch"] = out
        except Exception as exc:  # noqa: BLE001
            sides["hf-cb"]["batch"] = _skip(exc)
    if llama_path is not None:
        try:
            sides["llamacpp"]["batch"] = _timed(node_llama_cpp.run_batch, llama_path, batch, batch_size, threads, install)
        except Exception as exc:  # noqa: BLE001
            sides["llamacpp"]["batch"] = _skip(exc)
        if "skipped" not in sides["llamacpp"].get("single", {}) and tokenizer is not None:
            try:
                sanity = teacher_forced_sanity(tokenizer, llama_path, threads, hf_model, engine, install=install)
            except Exception as exc:  # noqa: BLE001
                sanity = {"error": f"{type(exc).__name__}: {exc}"}

    weights = side_weights(engine, hf_model, llama_path)
    return _result(server, sides, sanity, peers, threads, prompt_len, output_len, single_requests, batch_size,
                   batch_waves, llama_path, out_dir, weights)


def _result(server: Server, sides: dict[str, Any], sanity: dict[str, Any] | None, peers: Sequence[str], threads: int,
            prompt_len: int, output_len: int, single_requests: int, batch_size: int, batch_waves: int,
            llama_path: Path | None, out_dir: Path | None,
            weights: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    weights = weights or {}
    k_single = sides["kvserve"]["single"]["decode_tps"]
    k_batch = sides["kvserve"]["batch"]["tps"]
    ratios: dict[str, Any] = {}
    checks = []
    for phase, metric, k_value, label in (("single", "decode_tps", k_single, "single-stream decode"),
                                          ("batch", "tps", k_batch, f"{batch_size}-way throughput")):
        for peer in peers:
            target = TARGETS.get((phase, peer))
            side = sides[peer].get(phase, {})
            if target is None:
                continue
            r = ratio(k_value, side[metric]) if metric in side and side[metric] else None
            ratios[f"{phase}_vs_{peer}"] = r
            detail = (f"kvserve {k_value} vs {side[metric]} tok/s" if r is not None else "")
            checks.append(check(f"{label} kvserve / {SIDES[peer]}", r, target, detail=detail,
                                skipped=side.get("skipped") if r is None else None))
    if "kvserve-engine" in sides:
        e_single, e_batch = sides["kvserve-engine"]["single"]["decode_tps"], sides["kvserve-engine"]["batch"]["tps"]
        parts = []
        for peer in peers:
            for phase, metric, value in (("single", "decode_tps", e_single), ("batch", "tps", e_batch)):
                v = sides[peer].get(phase, {}).get(metric)
                if v:
                    ratios[f"engine_{phase}_vs_{peer}"] = ratio(value, v)
                    parts.append(f"{phase} vs {peer} {ratio(value, v)}x")
        checks.append(info("kvserve engine in process (no HTTP) / peers", "; ".join(parts) or "-",
                           f"(engine {e_single} / {e_batch} tok/s, server {k_single} / {k_batch})"))
    if "llamacpp" in peers:
        name = "teacher-forced top-1 agreement, llama.cpp vs transformers"
        if sanity is None:
            checks.append(info(name, "not run", sides["llamacpp"].get("single", {}).get("skipped", "")))
        elif "error" in sanity:
            checks.append(info(name, "error", sanity["error"]))
        else:
            for pair, a in sanity["pairs"].items():
                diffs = "; ".join(f"pos {i}: {x!r} vs {y!r}" for i, _, _, x, y in a["first_differences"])
                detail = f"{a['agree']} of {a['positions']} positions of a fixed text" + (
                    f" (first differences, reference vs llama.cpp: {diffs})" if diffs else "")
                if pair == "llama.cpp vs transformers":
                    checks.append(check(name, a["fraction"], AGREEMENT_TARGET, unit="", detail=detail))
                else:
                    checks.append(info(f"teacher-forced top-1 agreement, {pair}", a["fraction"], detail))

    rows = []
    for key in sides:
        s, b = sides[key].get("single", {}), sides[key].get("batch", {})
        w = weights.get(key)
        rows.append([SIDES[key], w["label"] if w else "-", f"{w['decode_bytes'] / 1e6:.0f}" if w else "-",
                     s.get("decode_tps", _missing(s)), s.get("ttft_ms"),
                     ratios.get(f"single_vs_{key}", ""),
                     b.get("tps", _missing(b)), b.get("elapsed_s"),
                     ratios.get(f"batch_vs_{key}", ""),
                     f"{_f(s.get('foreign_cpu_cores'))} / {_f(b.get('foreign_cpu_cores'))}"])
    skipped = [f"{SIDES[k]} ({phase}): {v[phase]['skipped']}" for k, v in sides.items() for phase in ("single", "batch")
               if "skipped" in v.get(phase, {}) and not v[phase]["skipped"].startswith("not measured")]
    result: dict[str, Any] = {
        "scenario": "peers", "title": "Peers on the same requests",
        "workload": {"prompt_len": prompt_len, "output_len": output_len, "single_requests": single_requests,
                     "batch_size": batch_size, "batch_requests": batch_size * batch_waves, "threads": threads,
                     "gguf": str(llama_path) if llama_path else None},
        "server": {"url": server.url, "kind": server.kind, "model": server.model},
        "sides": sides, "ratios": ratios, "agreement": sanity, "weights": weights, "checks": checks,
        "notes": [f"Same token-id prompts for every side: {prompt_len} prompt tokens, {output_len} output tokens "
                  f"(EOS ignored); single stream = {single_requests} requests one at a time (decode tokens/s, prefill "
                  f"excluded); batch = {batch_size * batch_waves} requests at {batch_size} concurrent / static batches "
                  f"of {batch_size} / {batch_size} parallel llama.cpp sequences (output tokens/s, prefill included). "
                  f"{threads} threads everywhere. kvserve/x and the targets use the HTTP server (client and SSE "
                  "included); the in-process engine row is the same engine without HTTP, as the peers run."]
                 + ([f"Skipped: {'; '.join(skipped)}"] if skipped else []),
        "tables": [table("peers: tokens/s on the same requests",
                         ["side", "weights", "MB read / token", "single decode tok/s", "single TTFT ms", "kvserve/x", f"batch {batch_size} tok/s",
                          "batch s", "kvserve/x", "other procs, cores (single / batch)"], rows)],
    }
    result["plots"] = _plot(result, out_dir) if out_dir else []
    result["machine"] = machine_info()
    return result


def _missing(side: dict[str, Any]) -> str | None:
    if "skipped" not in side:
        return None
    return "n/a" if side["skipped"].startswith("not measured") else "skipped"


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _plot(result: dict[str, Any], out_dir: Path) -> list[str]:
    fig, axes = new_figure(2, 4.6, 3.4)
    if fig is None:
        return []
    sides = result["sides"]
    for ax, (phase, metric, title) in zip(axes, (("single", "decode_tps", "single-stream decode"),
                                                 ("batch", "tps", f"batch {result['workload']['batch_size']} "
                                                                  "throughput"))):
        names, values, colors = [], [], []
        for key, side in sides.items():
            v = side.get(phase, {}).get(metric)
            if v:
                names.append(SIDES[key].replace("transformers ", "HF ").replace(" (node-llama-cpp)", "")
                             .replace(" (HTTP server)", " (HTTP)"))
                values.append(v)
                colors.append("#2a7" if key.startswith("kvserve") else "#888")
        bars = ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)), names, rotation=20, ha="right", fontsize=8)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
    return [save_figure(fig, out_dir / "peers.png")]
