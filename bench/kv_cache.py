"""Scenario ``kv-cache``: the seed's KV-cache experiment, with and without a cache.

1. One generation (a chat prompt, ``new_tokens`` greedy tokens) three ways: transformers
   ``generate(use_cache=True)``, ``generate(use_cache=False)`` (every step recomputes the whole
   sequence) and kvserve's engine; TTFT and TPOT (mean, first and last token) for each.
2. The cost of one new token as the context grows (8 .. 1,024 tokens):
   * without a cache, producing the token at context L is a forward pass over all L tokens;
   * with a cache (transformers' DynamicCache, kvserve's paged pool) it is one decode step
     that attends over L cached keys.
   Best of ``repeats``. A straight line fitted to each series gives the per-token cost
   a + b * L: without a cache it grows with L (so generating N tokens costs ~N^2), with a
   cache b is tiny (~N). The plot shows both, and the cumulative time to generate N tokens.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bench.engine_runs import kvserve_single
from bench.machine import machine_info
from bench.peers.transformers import TimingStreamer as _TimingStreamer, pad_id as _pad_id
from bench.report import finish_axes, info, new_figure, save_figure, table
from kvtypes.sampling_params import SamplingParams

DEFAULT_CONTEXTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def _cache_kw() -> str:
    """transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` is deprecated)."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


_CACHE_KW = _cache_kw()


def _cache_of(out: Any) -> Any:
    return out["cache"] if "cache" in out else out.past_key_values


def hf_generate_timed(model: Any, prompt: Sequence[int], new_tokens: int, use_cache: bool) -> dict[str, Any]:
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, use_cache=use_cache, streamer=streamer, pad_token_id=_pad_id(model))
    times = [start] + streamer.times
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return {"ttft_s": times[1] - start, "gaps_s": gaps}


def _summary(ttft_s: float, gaps: Sequence[float]) -> dict[str, Any]:
    return {"ttft_ms": round(1000 * ttft_s, 2),
            "tpot_ms": round(1000 * sum(gaps) / len(gaps), 2) if gaps else None,
            "tpot_first_ms": round(1000 * gaps[0], 2) if gaps else None,
            "tpot_last_ms": round(1000 * gaps[-1], 2) if gaps else None}


def kvserve_step_times(engine: Any, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """TTFT and every decode step's time for one request on an idle engine."""
    engine.add_request(list(prompt), SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0))
    start = time.perf_counter()
    stamps = []
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    return {"ttft_s": stamps[0] - start, "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])]}


def per_token_costs(engine: Any, model: Any, contexts: Sequence[int], vocab_size: int, repeats: int = 2,
                    decode_steps: int = 3, low_token_id: int = 100) -> list[dict[str, Any]]:
    rows = []
    low = min(low_token_id, vocab_size - 1)
    for L in contexts:
        rng = random.Random(L)
        ids = [rng.randrange(low, vocab_size) for _ in range(L)]
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            nocache = float("inf")
            for _ in range(repeats):  # no cache: the token at context L needs a pass over all L tokens
                t = time.perf_counter()
                model(input_ids=x, use_cache=False)
                nocache = min(nocache, time.perf_counter() - t)
            out = model(input_ids=x, use_cache=True)  # fills the cache (untimed)
            past, nxt = _cache_of(out), out.logits[:, -1:].argmax(-1)
            cached = float("inf")
            for _ in range(max(repeats, decode_steps)):  # with a cache: one decode step over L cached tokens
                t = time.perf_counter()
                out = model(input_ids=nxt, **{_CACHE_KW: past}, use_cache=True)
                cached = min(cached, time.perf_counter() - t)
                past, nxt = _cache_of(out), out.logits[:, -1:].argmax(-1)
        k = kvserve_step_times(engine, ids, 1 + max(repeats, decode_steps))
        engine.kv_cache.reset_prefix_cache()
        rows.append({"context": L, "hf_nocache_ms": round(1000 * nocache, 3), "hf_cache_ms": round(1000 * cached, 3),
                     "kvserve_ms": round(1000 * min(k["gaps_s"]), 3)})
    return rows


def _fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"a_ms": round(a, 4), "b_ms_per_token": round(b, 6), "r2": round(1 - ss_res / ss_tot, 4) if ss_tot else 1.0}


def run_kv_cache(engine: Any, hf_model: Any, prompt: Sequence[int], vocab_size: int, new_tokens: int = 32,
                 contexts: Sequence[int] = DEFAULT_CONTEXTS, repeats: int = 2,
                 out_dir: Path | None = None) -> dict[str, Any]:
    # warm-up: kernels for both
    kvserve_single(engine, prompt, 2)
    hf_generate_timed(hf_model, prompt, 2, True)
    engine.kv_cache.reset_prefix_cache()

    gen = {"kvserve": _summary(**_tg(kvserve_step_times(engine, prompt, new_tokens))),
           "hf_cache": _summary(**_tg(hf_generate_timed(hf_model, prompt, new_tokens, True))),
           "hf_nocache": _summary(**_tg(hf_generate_timed(hf_model, prompt, new_tokens, False)))}
    engine.kv_cache.reset_prefix_cache()
    costs = per_token_costs(engine, hf_model, contexts, vocab_size, repeats)
    xs = [r["context"] for r in costs]
    fits = {k: _fit(xs, [r[f"{k}_ms"] for r in costs]) for k in ("hf_nocache", "hf_cache", "kvserve")}
    first, last = costs[0], costs[-1]
    growth = {k: round(last[f"{k}_ms"] / first[f"{k}_ms"], 2) for k in ("hf_nocache", "hf_cache", "kvserve")}

    names = {"kvserve": "kvserve (paged KV cache)", "hf_cache": "transformers use_cache=True",
             "hf_nocache": "transformers use_cache=False"}
    result: dict[str, Any] = {
        "scenario": "kv-cache", "title": "The KV-cache experiment: with and without a cache",
        "workload": {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "contexts": list(contexts),
                     "repeats": repeats},
        "generation": gen, "per_token": costs, "fits": fits, "growth": growth,
        "notes": [f"Generation: a {len(prompt)}-token chat prompt, {new_tokens} greedy tokens. Per-token cost at "
                  "context L: without a cache, a forward pass over L tokens; with a cache, one decode step over L "
                  f"cached tokens (best of {repeats}). Fit: per-token ms = a + b*L."],
        "tables": [
            table("kv-cache: one generation", ["side", "TTFT ms", "TPOT mean ms", "TPOT first ms", "TPOT last ms"],
                  [[names[k], v["ttft_ms"], v["tpot_ms"], v["tpot_first_ms"], v["tpot_last_ms"]]
                   for k, v in gen.items()]),
            table("kv-cache: cost of one new token (ms) by context length",
                  ["context", "HF no cache", "HF cache", "kvserve"],
                  [[r["context"], r["hf_nocache_ms"], r["hf_cache_ms"], r["kvserve_ms"]] for r in costs]),
            table("kv-cache: per-token cost fit a + b*L",
                  ["side", "a ms", "b us/context token", "R^2", f"cost at {last['context']} / at {first['context']}"],
                  [[names[k], fits[k]["a_ms"], round(1000 * fits[k]["b_ms_per_token"], 3), fits[k]["r2"], growth[k]]
                   for k in fits]),
        ],
    }
    n = last["context"]
    total = {k: (fits[k]["a_ms"] * n + fits[k]["b_ms_per_token"] * n * n / 2) / 1000 for k in fits}
    result["checks"] = [
        info("per-token cost growth without a cache", growth["hf_nocache"],
             f"x from {first['context']} to {n} tokens of context (linear per token -> quadratic in total)"),
        info("per-token cost growth with a cache (HF / kvserve)", f"{growth['hf_cache']} / {growth['kvserve']}",
             "x (nearly flat -> linear in total)"),
        info(f"modelled time to generate {n} tokens, no cache / cache (HF)",
             round(total["hf_nocache"] / total["hf_cache"], 2) if total["hf_cache"] > 0 else None,
             f"x ({total['hf_nocache']:.1f} s vs {total['hf_cache']:.1f} s; kvserve {total['kvserve']:.1f} s)"),
        info("TPOT kvserve vs HF with cache / without cache",
             f"{gen['kvserve']['tpot_ms']} / {gen['hf_cache']['tpot_ms']} / {gen['hf_nocache']['tpot_ms']} ms"),
    ]
    result["plots"] = _plot(costs, fits, names, out_dir) if out_dir else []
    result["machine"] = machine_info()
    return result


def _tg(d: dict[str, Any]) -> dict[str, Any]:
    return {"ttft_s": d["ttft_s"], "gaps": d["gaps_s"]}


def _plot(costs: list[dict[str, Any]], fits: dict[str, Any], names: dict[str, str], out_dir: Path) -> list[str]:
    fig, axes = new_figure(2, 5.0, 3.6)
    if fig is None:
        return []
    xs = [r["context"] for r in costs]
    styles = {"hf_nocache": ("#c33", "o"), "hf_cache": ("#36c", "s"), "kvserve": ("#2a7", "^")}
    ax = axes[0]
    for k, (color, marker) in styles.items():
        ax.plot(xs, [r[f"{k}_ms"] for r in costs], marker, color=color, label=names[k])
        ax.plot(xs, [fits[k]["a_ms"] + fits[k]["b_ms_per_token"] * x for x in xs], "-", color=color, alpha=0.5)
    finish_axes(ax, "cost of one token", "context length (tokens)", "ms per new token")
    ax = axes[1]
    n_max = xs[-1]
    grid = list(range(0, n_max + 1, max(1, n_max // 64)))
    for k, (color, _) in styles.items():
        a, b = fits[k]["a_ms"], fits[k]["b_ms_per_token"]
        ax.plot(grid, [(a * n + b * n * n / 2) / 1000 for n in grid], "-", color=color, label=names[k])
    finish_axes(ax, "cumulative: quadratic vs linear", "tokens generated from an empty context",
                "seconds (from the fits)")
    return [save_figure(fig, out_dir / "kv-cache.png")]
