"""Scenario ``roofline``: this machine's limits, measured in the same run, and kvserve against them.

* compute bound: fp32 matmul GFLOP/s (``n x n @ n x n``, best of ``repeats``, the current
  torch thread count);
* bandwidth bound: read bandwidth of a ``sum`` over a buffer far larger than the caches
  (``bench.machine.memory_bandwidth_gbs``);
* kvserve's single-stream decode (engine, in process) against the bandwidth bound: every
  decode token streams all weights once (``weight_bytes_per_decode_token``: the GGUF blocks
  where the decode matmuls read them, fp32 elsewhere), so the bound is bandwidth / weight
  bytes tokens/s; target at least 80% of it;
* kvserve's peak throughput (``batch`` prompts generated together) against the compute bound:
  a token costs 2 FLOPs per weight (attention ignored), so the bound is GFLOP/s / (2 x
  weights) tokens/s;
* the decode step's own roofline (issue 39): the read bandwidth of a buffer the size of the
  decode weights (``model_bandwidth_gbs``) and the peak of the project's own kernels on a
  cache-resident matrix at many rows (``kernel_peaks``: ``gguf_linear_q8``, the int8-activation
  VNNI/AVX2 kernel, per block format the model's matmuls run, and the fp32 ``gguf_linear``), so
  an R-row decode step can take no less than max(weight bytes / bandwidth, R x MACs / peak)
  (``step_bound``); the in-process 16-row decode step against it (target: within 2x) and the
  step's breakdown at 1, 4, 8 and 16 rows (``bench.step_timing.decode_profile``), with
  the engine core's per-step IPC round trip (``bench.ipc_echo``) beside it. AMX is
  read from ``/proc/cpuinfo`` and from the kernel's own detection.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.engine_runs import kvserve_batch, kvserve_single, weight_bytes_per_decode_token
from bench.machine import CpuMonitor, machine_info, memory_bandwidth_gbs
from bench.report import check, info, new_figure, save_figure, table
from engine.platform.cpu_features import cpu_flags

BANDWIDTH_TARGET = 0.8
STEP_TARGET = 2.0  # issue 39: the 16-row decode step within 2x of its roofline
BREAKDOWN_ROWS = (1, 4, 8, 16)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


# ---- the decode step's roofline (issue 39) -----------------------------------------------------
def isa_report() -> dict[str, Any]:
    """What the int8 kernels can use here: the CPU's flags as the OS shows them and the
    kernels' own choice (``gguf_q8_isa``; ``gguf_q8_amx`` also asks Linux for the AMX state)."""
    flags = cpu_flags()  # engine/platform/cpu_features.py
    return {"avx512_vnni": "avx512_vnni" in flags, "avx_vnni": "avx_vnni" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "amx_cpuinfo": {f: f in flags for f in ("amx_tile", "amx_int8", "amx_bf16")},
            "kernel_q8_isa": str(torch.ops.kvserve.gguf_q8_isa()), "kernel_amx": bool(torch.ops.kvserve.gguf_q8_amx())}


def model_bandwidth_gbs(weight_bytes: int, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of a ``sum`` over a buffer of ``weight_bytes`` (the decode weights:
    the working set one step streams), best of ``repeats``."""
    return memory_bandwidth_gbs(max(1, round(weight_bytes / 2**20)), repeats)


def random_packed(fmt: Any, out_features: int, in_features: int, seed: int = 0) -> Any:
    """A ``PackedMatrix`` of random valid ``fmt`` blocks (``bench.make_gguf.random_blocks``)."""
    import numpy as np

    from bench.make_gguf import random_blocks
    from engine.loader.gguf.blocks import GGUFMatrix

    raw = random_blocks(fmt, out_features, in_features, np.random.default_rng(seed))
    return GGUFMatrix(torch.from_numpy(raw), fmt, in_features).pack()


def best_call_s(fn: Any, min_s: float) -> float:
    """Best seconds per call over as many calls as fit in ``min_s`` (at least 3), after a warm-up."""
    fn()
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        calls += 1
    return best


def kernel_peak_gops(op_name: str, fmt: Any, rows: int = 128, out_features: int = 512, in_features: int = 2048,
                     min_s: float = 0.3) -> float:
    """GOP/s (2 ops per multiply-add) of ``torch.ops.kvserve.<op_name>`` (``gguf_linear_q8`` or
    ``gguf_linear``) on a random ``fmt`` matrix small enough to stay in cache (512 x 2048 Q8_0:
    1.1 MB) at ``rows`` rows: the kernel's compute peak, not its bandwidth."""
    op = getattr(torch.ops.kvserve, op_name)
    m = random_packed(fmt, out_features, in_features)
    x = torch.randn(rows, in_features)
    fmt_id = int(m.format)
    seconds = best_call_s(lambda: op(x, m.data, m.out_features, fmt_id), min_s)
    return 2 * rows * out_features * in_features / seconds / 1e9


@dataclass(frozen=True)
class MatmulGroup:
    """The decode matmuls one kernel runs: ``op`` (``gguf_linear_q8`` / ``gguf_linear`` on
    ``fmt`` blocks, or ``dense`` fp32) and their multiply-adds per row."""

    op: str
    fmt: str
    macs_per_row: int


def decode_matmuls(model: Any) -> list[MatmulGroup]:
    """The model's decode matmuls grouped by the kernel bound to them now (``BlockLinear``
    parts by their format and op); what is not on blocks counts as dense fp32. Attention's
    own products (context-length dependent, small at short contexts) are left out."""
    groups: dict[tuple[str, str], int] = {}
    covered = 0
    from engine.loader.gguf.blocks import BlockFormat

    for mm in model.block_linears():
        for op, (_, out_features, fmt) in zip(mm.kernels, mm.parts):
            macs = out_features * mm.blocks.in_features
            key = (op._qualified_op_name.split("::")[-1], BlockFormat(fmt).name)
            groups[key] = groups.get(key, 0) + macs
            covered += macs
    total = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2) + model.lm_head.numel()
    if total > covered:
        groups[("dense", "fp32")] = total - covered
    return [MatmulGroup(op, fmt, macs) for (op, fmt), macs in groups.items()]


def decode_flops_per_token(model: Any) -> int:
    """2 x the multiply-adds of one decode token's matmuls (``decode_matmuls``: the layers' and
    the LM head's, on blocks or dense). Counting the model's torch parameters instead gave ~0 for
    a GGUF served from its blocks alone, which keeps no dense copy."""
    return 2 * sum(g.macs_per_row for g in decode_matmuls(model))


def kernel_peaks(groups: Sequence[MatmulGroup], matmul_gflops_value: float, min_s: float = 0.5,
                 rows: int = 128) -> dict[str, float]:
    """GOP/s per ``op:fmt`` of ``groups`` (the dense group: ``matmul_gflops_value``), plus the
    fp32 block kernel's for the same formats (for the table; the bound uses the bound op's)."""
    from engine.loader.gguf.blocks import BlockFormat

    peaks: dict[str, float] = {}
    for g in groups:
        if g.op == "dense":
            peaks["dense:fp32"] = matmul_gflops_value
            continue
        for op in dict.fromkeys([g.op, "gguf_linear"]):
            key = f"{op}:{g.fmt}"
            if key not in peaks:
                peaks[key] = kernel_peak_gops(op, BlockFormat[g.fmt], rows=rows, min_s=min_s)
    return peaks


def matmul_sweep_ms(model: Any, rows: int, min_s: float = 0.2) -> float:
    """Best ms of one pass over the model's block matmuls as bound (``block_linears``: each
    layer's, then the LM head) at ``rows`` random rows: the step's matmuls alone, their weights
    coming from memory as in a step (the pass reads them all). Dense matmuls are not included."""
    mms = model.block_linears()
    xs = {mm.blocks.in_features: torch.randn(rows, mm.blocks.in_features) for mm in mms}
    with torch.inference_mode():
        return 1000 * best_call_s(lambda: [mm(xs[mm.blocks.in_features]) for mm in mms], min_s)


def step_bound(groups: Sequence[MatmulGroup], weight_bytes: int, bandwidth_gbs: float, peaks: dict[str, float],
               rows: int) -> dict[str, Any]:
    """The least time an ``rows``-row decode step can take here: streaming the weights once
    (``weight_bytes / bandwidth``) or doing its multiply-adds at each kernel's peak, whichever
    is longer."""
    bytes_ms = 1000 * weight_bytes / (bandwidth_gbs * 1e9)
    compute_ms = 1000 * sum(2 * rows * g.macs_per_row / (peaks[f"{g.op}:{g.fmt}"] * 1e9) for g in groups)
    return {"rows": rows, "bytes_ms": bytes_ms, "compute_ms": compute_ms, "bound_ms": max(bytes_ms, compute_ms),
            "bound_by": "bandwidth" if bytes_ms >= compute_ms else "compute"}


def step_roofline(engine: Any, rows_levels: Sequence[int] = BREAKDOWN_ROWS, prompt_len: int = 50,
                  tokens: int = 32, repeats: int = 5, kernel_min_s: float = 0.5, peak_rows: int = 128,
                  matmul_gflops_value: float | None = None, ipc: bool = True) -> dict[str, Any]:
    """The decode step against its roofline at each of ``rows_levels`` rows: the bounds
    (``step_bound``), the measured decode step in process and its pieces (``decode_profile``,
    the best of ``min(repeats, 3)`` rounds), the largest row count's ratio, and the per-step IPC
    round trip."""
    from bench.step_timing import decode_profile

    model = engine.runner.model
    weight_bytes = weight_bytes_per_decode_token(engine)
    groups = decode_matmuls(model)
    bandwidth = model_bandwidth_gbs(weight_bytes, repeats)
    gflops = matmul_gflops_value if matmul_gflops_value is not None else matmul_gflops()
    peaks = kernel_peaks(groups, gflops, kernel_min_s, peak_rows)
    engine.kv_cache.reset_prefix_cache()
    rounds = min(repeats, 3)
    with CpuMonitor() as load:
        profile = decode_profile(engine, list(rows_levels), prompt_len, tokens, rounds=rounds)
    engine.kv_cache.reset_prefix_cache()
    # Bounds measured again after the steps, the better of the two kept: what the machine can do
    # (a neighbour's load only lowers a run; on a loaded 2-core machine one 2-thread call in many
    # has both cores, and one bad window took a kernel's peak 30x down).
    bandwidth = max(bandwidth, model_bandwidth_gbs(weight_bytes, repeats))
    after = kernel_peaks(groups, gflops, kernel_min_s, peak_rows)
    peaks = {k: max(v, after[k]) for k, v in peaks.items()}
    ipc_us = {n: ipc_round_trip_us(n) for n in rows_levels} if ipc else {}
    rows = []
    for prof in profile:
        bound = step_bound(groups, weight_bytes, bandwidth, peaks, prof["rows"])
        rows.append({**prof, **bound, "ratio": prof["step_ms"] / bound["bound_ms"],
                     "matmuls_alone_ms": matmul_sweep_ms(model, prof["rows"], kernel_min_s),
                     "ipc_ms": ipc_us[prof["rows"]] / 1000 if prof["rows"] in ipc_us else None})
    return {"isa": isa_report(), "weight_bytes": weight_bytes, "model_bandwidth_gbs": bandwidth,
            "bandwidth_mib": max(1, round(weight_bytes / 2**20)), "peaks_gops": peaks, "peak_rows": peak_rows,
            "matmuls": [vars(g) for g in groups], "prompt_len": prompt_len, "tokens": tokens, "steps": rows,
            "step_rounds": rounds,
            "foreign_cores": load.foreign_cores, "loadavg_1m": round(os.getloadavg()[0], 2)}


def ipc_round_trip_us(num_requests: int, rounds: int = 500) -> float | None:
    """Median echo round trip (us) of one step message of ``num_requests`` requests over the
    pipe the engine core process uses (``bench.ipc_echo``); None where it fails."""
    from bench.ipc_echo import pipe_round_trip_us

    try:
        return pipe_round_trip_us(num_requests, rounds)
    except (OSError, RuntimeError):
        return None


def run_roofline(engine: Any, single_prompts: Sequence[Sequence[int]], batch_prompts: Sequence[Sequence[int]],
                 new_tokens: int = 32, matmul_n: int = 2048, bandwidth_mib: int = 1024, repeats: int = 5,
                 out_dir: Path | None = None, rows_levels: Sequence[int] = BREAKDOWN_ROWS, step_tokens: int = 32,
                 step_prompt_len: int = 50, kernel_min_s: float = 0.5, ipc: bool = True) -> dict[str, Any]:
    """The fp32 roofline (single stream, peak batch) and the decode step's own (``step_roofline``
    at ``rows_levels`` rows; the step check is on the largest)."""
    first_gflops = matmul_gflops(matmul_n, repeats)
    first_bandwidth = memory_bandwidth_gbs(bandwidth_mib, repeats)
    weight_bytes = weight_bytes_per_decode_token(engine)
    model = engine.runner.model
    flops_per_token = decode_flops_per_token(model)

    kvserve_single(engine, single_prompts[0], 4)  # warm-up
    engine.kv_cache.reset_prefix_cache()
    runs = [kvserve_single(engine, p, new_tokens) for p in single_prompts]
    single_tps = sum(len(r["tokens"]) - 1 for r in runs) / sum(r["decode_s"] for r in runs)
    engine.kv_cache.reset_prefix_cache()
    batch = kvserve_batch(engine, batch_prompts, new_tokens)
    engine.kv_cache.reset_prefix_cache()
    batch_tps = len(batch_prompts) * new_tokens / batch["elapsed_s"]
    # Measured again after the model ran; the bound is the better of the two (it is what the
    # machine can do; the worse one only says how much a neighbour took at that moment).
    bandwidth_after = memory_bandwidth_gbs(bandwidth_mib, repeats)
    gflops_after = matmul_gflops(matmul_n, repeats)
    gflops, bandwidth = max(first_gflops, gflops_after), max(first_bandwidth, bandwidth_after)
    bw_bound = bandwidth * 1e9 / weight_bytes
    compute_bound = gflops * 1e9 / flops_per_token

    bw_fraction = single_tps / bw_bound
    compute_fraction = batch_tps / compute_bound
    result: dict[str, Any] = {
        "scenario": "roofline", "title": "Roofline: kvserve against this machine's bounds",
        "machine_bounds": {"matmul_gflops": round(gflops, 2), "matmul_gflops_runs": [round(first_gflops, 2),
                                                                                     round(gflops_after, 2)],
                           "bandwidth_gbs": round(bandwidth, 2), "bandwidth_gbs_runs": [round(first_bandwidth, 2),
                                                                                       round(bandwidth_after, 2)],
                           "matmul_n": matmul_n, "bandwidth_mib": bandwidth_mib},
        "model": {"weight_bytes_per_token": weight_bytes, "flops_per_token": flops_per_token},
        "bandwidth_bound_tps": round(bw_bound, 2), "compute_bound_tps": round(compute_bound, 2),
        "kvserve_single_decode_tps": round(single_tps, 3), "kvserve_batch_tps": round(batch_tps, 3),
        "batch_size": len(batch_prompts), "new_tokens": new_tokens,
        "bandwidth_fraction": round(bw_fraction, 4), "compute_fraction": round(compute_fraction, 4),
        "achieved_gbs_single": round(single_tps * weight_bytes / 1e9, 2),
        "achieved_gflops_batch": round(batch_tps * flops_per_token / 1e9, 2),
        "notes": [f"fp32 matmul {matmul_n}^3 and a {bandwidth_mib} MiB sum, best of {repeats}, measured before and "
                  f"after the model ran (the better one is the bound); {weight_bytes / 1e6:.0f} MB of weights "
                  "streamed per decode token, "
                  f"{flops_per_token / 1e9:.2f} GFLOP per token. Single stream: {len(single_prompts)} prompts x "
                  f"{new_tokens} tokens (decode only); peak: {len(batch_prompts)} prompts x {new_tokens} tokens "
                  "together (prefill included), engine in process."],
    }
    result["tables"] = [table("roofline", ["measure", "machine bound", "kvserve", "fraction"], [
        ["memory bandwidth GB/s (sum)", round(bandwidth, 2), result["achieved_gbs_single"], round(bw_fraction, 3)],
        ["single-stream decode tokens/s", round(bw_bound, 2), round(single_tps, 2), round(bw_fraction, 3)],
        ["fp32 matmul GFLOP/s", round(gflops, 2), result["achieved_gflops_batch"], round(compute_fraction, 3)],
        [f"peak throughput tokens/s (batch {len(batch_prompts)})", round(compute_bound, 2), round(batch_tps, 2),
         round(compute_fraction, 3)],
    ])]
    result["checks"] = [
        check("single-stream decode / memory-bandwidth bound", bw_fraction, BANDWIDTH_TARGET, unit="",
              detail=f"{single_tps:.1f} of {bw_bound:.1f} tok/s at {bandwidth:.1f} GB/s "
                     f"(runs: {first_bandwidth:.1f}, {bandwidth_after:.1f})"),
        info("peak throughput / compute bound", round(compute_fraction, 3),
             f"{batch_tps:.1f} of {compute_bound:.1f} tok/s at {gflops:.1f} GFLOP/s (runs: {first_gflops:.1f}, "
             f"{gflops_after:.1f})"),
    ]
    step = step_roofline(engine, rows_levels, step_prompt_len, step_tokens, repeats, kernel_min_s,
                         matmul_gflops_value=gflops, ipc=ipc)
    result["step_roofline"] = step
    result["tables"] += step_tables(step)
    result["checks"] += step_checks(step)
    result["notes"].append(step_note(step))
    result["plots"] = _plot(result, out_dir) if out_dir else []
    result["machine"] = machine_info()
    return result


def step_tables(step: dict[str, Any]) -> list[dict[str, Any]]:
    """The bounds (bandwidth, kernel peaks, ISA) and, per row count, the step against its
    roofline and where its time goes."""
    from bench.step_timing import PIECES

    isa = step["isa"]
    amx = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in isa["amx_cpuinfo"].items())
    bounds = [["read bandwidth, buffer the size of the decode weights", f"{step['model_bandwidth_gbs']:.2f} GB/s",
               f"{step['bandwidth_mib']} MiB sum, best of the runs before and after the steps"]]
    for key, gops in step["peaks_gops"].items():
        op, fmt = key.split(":")
        what = ("fp32 matmul (torch mm)" if op == "dense" else
                f"{op} on {fmt} blocks ({'int8 activations' if op.endswith('_q8') else 'fp32 activations'})")
        bounds.append([f"peak, {what}", f"{gops:.1f} GOP/s",
                       "as bound" if any(f"{g['op']}:{g['fmt']}" == key for g in step["matmuls"]) else "for comparison"])
    bounds.append(["int8 ISA of the kernels", isa["kernel_q8_isa"],
                   f"avx512_vnni {'yes' if isa['avx512_vnni'] else 'no'}, avx512_bf16 "
                   f"{'yes' if isa['avx512_bf16'] else 'no'}"])
    bounds.append(["AMX", "yes" if isa["kernel_amx"] else "no (not exposed)", f"/proc/cpuinfo: {amx}"])
    labels = [label for label, _, _ in PIECES]
    rows = []
    for r in step["steps"]:
        pieces = r["pieces_ms"]
        rows.append([r["rows"], round(r["bytes_ms"], 2), round(r["compute_ms"], 2), round(r["bound_ms"], 2),
                     round(r["step_ms"], 2), round(r["ratio"], 2), round(r["matmuls_alone_ms"], 2),
                     *[round(pieces[k], 2) if k in pieces else "-" for k in labels], round(r["other_ms"], 2),
                     "-" if r["ipc_ms"] is None else round(r["ipc_ms"], 3)])
    header = ["rows", "bytes / bw ms", "MACs / peak ms", "roofline ms", "step ms", "step / roofline", "matmuls alone ms",
              *[label.strip() for label in labels], "other (engine) ms", "IPC round trip ms"]
    return [table("decode step bounds on this machine", ["bound", "value", "how"], bounds),
            table("decode step in process: roofline and where the time goes (ms per step)", header, rows)]


def step_checks(step: dict[str, Any]) -> list[dict[str, Any]]:
    last = max(step["steps"], key=lambda r: r["rows"])
    rounds = ", ".join(f"{x:.2f}" for x in last.get("step_ms_rounds", []))
    return [check(f"{last['rows']}-row decode step / its roofline", round(last["ratio"], 3), STEP_TARGET,
                  higher_is_better=False,
                  detail=f"step {last['step_ms']:.2f} ms (rounds: {rounds}), "
                         f"roofline {last['bound_ms']:.2f} ms ({last['bound_by']} bound)")]


def step_note(step: dict[str, Any]) -> str:
    return (f"Decode step roofline: {step['weight_bytes'] / 1e6:.1f} MB of weights per step over the read bandwidth "
            f"of a {step['bandwidth_mib']} MiB buffer, against each decode matmul's multiply-adds at its kernel's "
            f"peak ({step['peak_rows']} rows on a cache-resident 512 x 2048 random matrix of its format); attention "
            "and everything but the matmuls are outside the bound. Steps: pure decode steps of the given rows "
            f"({step['prompt_len']}-token prompts, {step['tokens']} tokens each), engine in process, the round "
            f"with the lowest mean step of {step.get('step_rounds', 1)} (as the bounds are the best of their runs), "
            "each piece timed "
            "by wrapping its method (bench.step_timing); 'other' is the step less its top-level pieces. "
            "'matmuls alone': one pass over the model's block matmuls at the step's rows, random inputs, weights "
            "from memory (the layers' and LM head's matmul time without attention, norms, RoPE and the rest). "
            "IPC: the echo round trip of one step message over the engine core's pipe (one way is about half); "
            "the frontend's CPU per token is not measured here (python -m bench.probes.frontend_cost). Other "
            f"processes used {step['foreign_cores']} cores while the steps ran (load average "
            f"{step['loadavg_1m']} after).")


def _plot(r: dict[str, Any], out_dir: Path) -> list[str]:
    fig, ax = new_figure(1, 5.2, 3.8)
    if fig is None:
        return []
    peak, bw = r["machine_bounds"]["matmul_gflops"], r["machine_bounds"]["bandwidth_gbs"]
    intensities = [2 ** (i / 4) for i in range(-12, 41)]  # FLOP per byte
    ax.plot(intensities, [min(peak, bw * x) for x in intensities], "-", color="#333", label="roofline")
    fpt, wb = r["model"]["flops_per_token"], r["model"]["weight_bytes_per_token"]
    single_ai = fpt / wb
    batch_ai = single_ai * r["batch_size"]
    ax.plot([single_ai], [r["kvserve_single_decode_tps"] * fpt / 1e9], "o", color="#2a7", label="kvserve batch 1")
    ax.plot([batch_ai], [r["kvserve_batch_tps"] * fpt / 1e9], "s", color="#36c",
            label=f"kvserve batch {r['batch_size']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / weight byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("fp32 roofline (measured)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return [save_figure(fig, out_dir / "roofline.png")]
