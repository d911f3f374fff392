"""Issue 40's speed/quality table of KV compression, in one run (default model, engine in process).

    python -m bench.probes.kv_compression [--tokens 2048] [--score-from 512] [--window 256] [--sinks 4]
        [--chunk 64] [--pool-gib 1] [--request-tokens 8192] [--step-tokens 512] [--streams 16] [--decode-prompt 384]
        [--decode-tokens 32] [--flat-window 1024] [--flat-totals 8192 16384 32768] [--flat-decode 64]
        [--h2o-backend auto] [--skip table,flat,peer] [--json FILE]

Three sections, each printed as a Markdown table with the machine's load beside it:

1. **Policies** (dense fp32, fp16, int8, int4 KV; streaming sinks + window; streaming window only;
   h2o at the budget sinks + window hold), one row each:
   * teacher-forced quality on the first ``--tokens`` tokens of CPython's ``pydoc_data.topics``
     (prompt logprobs, prefill chunks of ``--chunk`` tokens; bench.probes.kv_eviction's text):
     mean NLL on positions ``--score-from`` on, its delta to dense fp32 KV, and the top-1
     agreement with dense fp32 KV;
   * pool bytes per token (``engine.capacity.bytes_per_token``, the pool's own accounting) and KV
     bytes held per token of the text (the peak of the pool's blocks in use during that run);
   * how many ``--request-tokens``-token requests run at once in a pool of ``--pool-gib`` GiB:
     derived from the pool's blocks and the peak blocks one such request holds, then verified by
     admitting requests into that pool: ``n`` submitted together all run at once with no
     preemption, ``n + 1`` do not. The admission drives the engine's own scheduler and cache
     manager (its eviction policy included) and skips the model: holding KV is bookkeeping, so
     the count is exact and costs no compute;
   * decode tokens/s at ``--streams`` streams (``--decode-prompt``-token prompts, past the window
     so that eviction acts), the engines stepping in lockstep (bench.probes.kv_int8.decode_rates),
     and the ratio to dense fp32 KV.
   The eviction rows run the CPU default KV dtype (``auto``: fp16) and, h2o included, the default
   attention backend (``--h2o-backend torch`` runs h2o on the torch backend's explicit softmax).
2. **Streaming flatness**: one stream, sinks + ``--flat-window``, prompts of each
   ``--flat-totals`` less ``--flat-decode`` tokens, decode tokens/s over the last
   ``--flat-decode`` tokens; the dense column is the same engine with the request's
   ``kv_eviction: false`` (what the server's per-request field does): it runs where the context
   holds the request and shows the engine's refusal (the server's 400 context_length_exceeded)
   where it does not.
3. **kvpress peer** (optional: ``pip install --no-deps kvpress cachetools fire termcolor``):
   kvpress's ``StreamingLLMPress`` under its ``DecodingPress`` (compress after every forward, to
   the sink block + the window: the set kvserve keeps before each step, with whole 16-token
   blocks and ``--chunk`` a multiple of 16) on transformers with the same weights, same text,
   same chunks; NLL and delta to transformers' own dense run beside kvserve's, the top-1
   agreement of the two streaming runs, and single-stream decode tokens/s after the text
   (kvpress compressing every 16 tokens, as kvserve evicts a block). Skipped, with the reason,
   when kvpress does not import.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import torch

from bench.machine import CpuMonitor, cpu_model, machine_info
from bench.probes.kv_eviction import text_tokens
from bench.probes.kv_int8 import decode_rates
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler

BLOCK = 16  # the pool's block size (CacheConfig's default): sinks and budgets round to it
H2O_BACKEND = "auto"  # native on the CPU: its kernels export the block mass h2o reads


@dataclass(frozen=True)
class Policy:
    """One row: a KV dtype (``--kv-cache-dtype``) and an eviction policy with its parameters."""

    label: str
    kv_dtype: str
    eviction: str = "none"
    sinks: int = 4
    window: int | None = None
    budget: int | None = None
    backend: str = "auto"


def policies(sinks: int, window: int, h2o_backend: str = H2O_BACKEND) -> list[Policy]:
    """The table's rows; the first is the reference (dense fp32 KV). h2o's budget is what sinks
    + window hold (the sink blocks and the window)."""
    budget = math.ceil(sinks / BLOCK) * BLOCK + window
    return [Policy("dense fp32", "float32"), Policy("dense fp16", "float16"), Policy("dense int8", "int8"),
            Policy("dense int4 (KIVI)", "int4"),
            Policy(f"streaming {sinks} sinks + {window} window", "auto", "streaming", sinks, window),
            Policy(f"streaming {window} window, no sinks", "auto", "streaming", 0, window),
            Policy(f"h2o budget {budget} ({h2o_backend} backend)", "auto", "h2o", sinks, budget=budget,
                   backend=h2o_backend)]


# make_engine(policy, max_model_len=, max_num_batched_tokens=, max_num_seqs=, kv_gib= | num_blocks=)
EngineFactory = Callable[..., Any]


def default_engine(policy: Policy, *, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                   kv_gib: float | None = None, num_blocks: int | None = None, num_threads: int | None = None):
    """The default model under ``policy``, its pool ``kv_gib`` GiB or ``num_blocks`` blocks."""
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine

    evict = {} if policy.eviction == "none" else dict(
        kv_eviction=policy.eviction, kv_sink_tokens=policy.sinks, kv_window_tokens=policy.window,
        kv_budget_tokens=policy.budget)
    cache = CacheConfig(kv_cache_memory_gib=kv_gib or 1.0, num_blocks=num_blocks, kv_cache_dtype=policy.kv_dtype,
                        **evict)
    return LLMEngine(EngineConfig(
        model=ModelConfig(max_model_len=max_model_len, attention_backend=policy.backend, num_threads=num_threads),
        cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                               max_num_seqs=max_num_seqs)))


# ---- 1. quality and bytes -------------------------------------------------------------------------
def teacher_forced(engine: Any, ids: Sequence[int]) -> tuple[list[tuple[float, int]], int]:
    """(logprob of the next token, top-1 id) at each position from 0 on, and the peak of the
    pool's blocks in use while the text ran (prefill chunks of the engine's step budget). Two
    output tokens, so that the request still holds its blocks after its last chunk's step."""
    engine.add_request(list(ids), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True))
    logprobs, peak = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            logprobs = out.prompt_logprobs or logprobs
        peak = max(peak, engine.kv_cache.num_blocks_held())
    return [(lp.logprob, lp.top[0][0]) for lp in logprobs], peak


def score(rows: Sequence[tuple[float, int]], ref: Sequence[tuple[float, int]], score_from: int) -> dict[str, float]:
    """Mean NLL over positions ``score_from`` on (rows[i] predicts token i + 1) and the top-1
    agreement with ``ref`` there."""
    scored, against = rows[score_from - 1:], ref[score_from - 1:]
    return {"nll": -sum(lp for lp, _ in scored) / len(scored),
            "top1": sum(a[1] == b[1] for a, b in zip(scored, against)) / len(scored)}


# ---- 1. concurrency in a fixed pool ----------------------------------------------------------------
def admit(engine: Any, n: int, request_tokens: int, budget: int, seed: int = 0,
          output_tokens: int | None = None) -> dict[str, int]:
    """Submit ``n`` requests of ``request_tokens`` tokens (distinct random prompts, greedy output,
    EOS ignored) at once to a scheduler over ``engine``'s cache manager and run them to the end
    without the model (a fixed token is "sampled"). Returns the peak of requests running at once,
    the preemptions, and the peak of the pool's blocks in use. The output is long enough for the
    first request to be decoding still when the ``n``-th has finished its prompt (step budget
    ``budget`` shared by prefill chunks and decodes), so that all can hold their KV at once."""
    f = 1.25 * (n + 1) / max(1, budget - n - 1)
    out = output_tokens or min(request_tokens // 2, max(16, math.ceil(request_tokens * f / (1 + f))))
    config = replace(engine.scheduler.config, max_num_batched_tokens=budget)
    engine.scheduler = sched = Scheduler(config, engine.kv_cache)
    rng = random.Random(seed)
    low = min(100, engine.arch.vocab_size // 2)
    for i in range(n):
        prompt = [rng.randrange(low, engine.arch.vocab_size) for _ in range(request_tokens - out)]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), f"admit-{n}-{i}")
    token = low  # any id: nothing reads it
    peak = preempted = blocks = 0
    for _ in range(100 * (n + 1) * request_tokens // max(1, min(budget, out)) + 1000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        preempted += len(plan.preempted)
        peak = max(peak, len(sched.running))
        blocks = max(blocks, engine.kv_cache.num_blocks_held())
        sched.update(plan, {s.request.request_id: token for s in plan.scheduled})
    else:
        raise RuntimeError(f"admitting {n} requests did not finish")
    return {"peak_running": peak, "preemptions": preempted, "peak_blocks": blocks, "output_tokens": out}


def max_concurrent(engine: Any, request_tokens: int, budget: int, cap: int) -> dict[str, Any]:
    """Requests of ``request_tokens`` tokens that run at once without preemption in ``engine``'s
    pool. ``derived``: the pool's blocks // the peak blocks one request holds alone (exact for
    dense KV; a lower bound under eviction, where requests running together share the step's
    chunk and so each holds less than one alone). ``verified``: the largest ``n`` for which
    ``admit`` ran all ``n`` at once with no preemption, found by galloping up from ``derived``
    and bisecting (fitting is monotone in ``n``), at most ``cap`` (``max_num_seqs``)."""
    one = admit(engine, 1, request_tokens, budget, seed=1)
    per_request = one["peak_blocks"]
    derived = engine.capacity.num_blocks // per_request if per_request else 0
    tried: dict[int, bool] = {0: True}

    def fits(n: int) -> bool:
        if n not in tried:
            r = admit(engine, n, request_tokens, budget, seed=n)
            tried[n] = r["peak_running"] == n and r["preemptions"] == 0
        return tried[n]

    lo = min(derived, cap)
    while lo > 0 and not fits(lo):
        lo -= 1
    step, hi = 1, None  # lo fits; hi (when known) does not
    while hi is None and lo < cap:
        probe = min(lo + step, cap)
        if fits(probe):
            lo, step = probe, step * 2
        else:
            hi = probe
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"derived": derived, "verified": lo, "capped": lo == cap, "blocks_per_request": per_request,
            "pool_blocks": engine.capacity.num_blocks, "admissions": len(tried) - 1}


# ---- 2. streaming flatness -------------------------------------------------------------------------
def decode_rate(engine: Any, prompt: Sequence[int], new_tokens: int, evict: bool | None = None) -> float:
    """Tokens/s over ``new_tokens`` greedy decode steps after ``prompt`` (first token to last)."""
    engine.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True,
                                                    kv_eviction=evict))
    stamps = []
    while engine.has_unfinished():
        if any(o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    return new_tokens / (stamps[-1] - stamps[0])


def flatness(engine: Any, totals: Sequence[int], new_tokens: int, vocab: int) -> list[dict[str, Any]]:
    """Per total: streaming decode tokens/s, and dense's (the request's ``kv_eviction`` false) or
    the engine's refusal of it; the foreign CPU load over each streaming measurement."""
    rows = []
    rng = random.Random(7)
    for total in totals:
        prompt = [rng.randrange(min(100, vocab // 2), vocab) for _ in range(total - new_tokens - 1)]
        print(f"  flatness: {total} tokens", flush=True)
        with CpuMonitor() as mon:
            rate = decode_rate(engine, prompt, new_tokens)
        try:
            engine.validate_prompt(prompt, SamplingParams(max_tokens=new_tokens + 1, kv_eviction=False))
            dense: float | str = decode_rate(engine, prompt, new_tokens, evict=False)
        except ValueError as exc:  # the server answers it with 400 context_length_exceeded
            dense = f"refused: {exc}"
        rows.append({"total_tokens": total, "streaming_tps": rate, "dense_tps": dense,
                     "foreign_cores": mon.foreign_cores})
    return rows


# ---- 3. the kvpress peer ---------------------------------------------------------------------------
def kvpress_missing() -> str | None:
    """Why the kvpress peer cannot run here, or None."""
    try:
        import kvpress  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return f"kvpress does not import: {type(exc).__name__}: {exc}"
    return None


@torch.inference_mode()
def hf_teacher_forced(hf: Any, ids: Sequence[int], chunk: int, press: Any = None) -> list[tuple[float, int]]:
    """(logprob of the next token, top-1 id) at each position, in chunks of ``chunk`` tokens at
    their text positions, the kvpress ``press`` (None: dense) applied around every forward."""
    import contextlib

    from transformers import DynamicCache

    cache, out, c = DynamicCache(), [], 0
    with press(hf) if press is not None else contextlib.nullcontext():
        while c < len(ids):
            n = min(chunk, len(ids) - c)
            held = cache.get_seq_length()
            logits = hf(input_ids=torch.tensor([ids[c:c + n]]), position_ids=torch.tensor([list(range(c, c + n))]),
                        cache_position=torch.arange(held, held + n), **{_cache_kw(): cache}, use_cache=True).logits
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            for i in range(n):
                if c + i + 1 < len(ids):
                    out.append((float(logp[i, ids[c + i + 1]]), int(logp[i].argmax())))
            c += n
    return out


@torch.inference_mode()
def hf_decode_rate(hf: Any, ids: Sequence[int], chunk: int, new_tokens: int, press: Any) -> float:
    """Greedy tokens/s over ``new_tokens`` single-token steps after ``ids`` (prefilled in chunks
    under ``press``), the press compressing during the decode too."""
    from transformers import DynamicCache

    cache, c, nxt = DynamicCache(), 0, None
    with press(hf):
        while c < len(ids):
            n = min(chunk, len(ids) - c)
            held = cache.get_seq_length()
            logits = hf(input_ids=torch.tensor([ids[c:c + n]]), position_ids=torch.tensor([list(range(c, c + n))]),
                        cache_position=torch.arange(held, held + n), **{_cache_kw(): cache}, use_cache=True).logits
            nxt, c = int(logits[0, -1].argmax()), c + n
        t0 = time.perf_counter()
        for pos in range(len(ids), len(ids) + new_tokens):
            held = cache.get_seq_length()
            logits = hf(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[pos]]),
                        cache_position=torch.arange(held, held + 1), **{_cache_kw(): cache}, use_cache=True).logits
            nxt = int(logits[0, -1].argmax())
    return new_tokens / (time.perf_counter() - t0)


def streaming_press(sinks: int, window: int, interval: int, keep_order: bool = True) -> Any:
    """kvpress's StreamingLLM press keeping what kvserve keeps: the sink blocks (whole) and the
    last ``window`` tokens, compressing every ``interval`` forwards (before that it holds more).

    ``keep_order``: kvpress's ``ScorerPress.compress`` gathers the kept keys in ``topk`` order,
    which for StreamingLLM's tied scores is not text order; one compression does not mind
    (attention is order-free), but StreamingLLM scores by cache index, so every later one (under
    ``DecodingPress``) prunes tokens that are not the oldest. With ``keep_order`` the same kept
    set is gathered in ascending index order (``ordered_press``); without, kvpress as shipped."""
    from kvpress import DecodingPress, StreamingLLMPress

    keep_sinks = math.ceil(sinks / BLOCK) * BLOCK
    base = (ordered_press(StreamingLLMPress) if keep_order else StreamingLLMPress)(n_sink=keep_sinks)
    press = DecodingPress(base_press=base, compression_interval=interval, target_size=keep_sinks + window,
                          hidden_states_buffer_size=0)
    hook = press.forward_hook

    # kvpress 0.5.5 (which pins transformers < 5.3) reads the attention layer's cache as the
    # keyword ``past_key_values``; transformers >= 5.2x passes it as ``cache``. The one shim:
    def forward_hook(module: Any, inputs: Any, kwargs: dict, output: Any) -> Any:
        if "past_key_values" not in kwargs and "cache" in kwargs:
            kwargs = {**kwargs, "past_key_values": kwargs["cache"]}
        return hook(module, inputs, kwargs, output)

    press.forward_hook = forward_hook  # BasePress.__call__ registers self.forward_hook
    return press


def ordered_press(cls: type) -> type:
    """``cls`` (a kvpress ScorerPress) whose ``compress`` keeps the same ``topk`` set as kvpress's,
    gathered in ascending cache index (text) order."""
    from kvpress.utils import compute_n_kept

    class Ordered(cls):  # type: ignore[misc, valid-type]
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):  # noqa: ANN001
            if self.compression_ratio == 0:
                return keys, values
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
            index = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
            index = index.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            return keys.gather(2, index).contiguous(), values.gather(2, index).contiguous()

    Ordered.__name__ = f"Ordered{cls.__name__}"
    return Ordered


def _cache_kw() -> str:
    """The model's keyword for the cache (transformers >= 5.2x: ``cache``, before: ``past_key_values``)."""
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def kvpress_peer(hf: Any, ids: Sequence[int], engine_rows: dict[str, list[tuple[float, int]]],
                 engine_dense_nll: float, sinks: int, window: int, chunk: int, score_from: int,
                 decode_tokens: int, engine_decode_tps: float) -> dict[str, Any]:
    dense = hf_teacher_forced(hf, ids, chunk)
    base = score(dense, dense, score_from)
    rows = []
    for label, s, ordered in ((f"{sinks} sinks + {window} window", sinks, True),
                              (f"{window} window, no sinks", 0, True),
                              (f"{sinks} sinks + {window} window", sinks, False)):
        pressed = hf_teacher_forced(hf, ids, chunk, streaming_press(s, window, 1, ordered))
        ours = engine_rows[label]
        label = label if ordered else f"{label}, kvpress as shipped (reordered cache)"
        k, p = score(ours, ours, score_from)["nll"], score(pressed, dense, score_from)
        rows.append({"policy": label, "kvpress_nll": p["nll"], "kvpress_delta": p["nll"] - base["nll"],
                     "kvpress_top1_vs_dense": p["top1"], "kvserve_nll": k, "kvserve_delta": k - engine_dense_nll,
                     "top1_kvserve_vs_kvpress": score(ours, pressed, score_from)["top1"]})
    with CpuMonitor() as mon:
        hf_tps = hf_decode_rate(hf, ids, chunk, decode_tokens, streaming_press(sinks, window, BLOCK))
    return {"hf_dense_nll": base["nll"], "rows": rows, "kvpress_decode_tps": hf_tps,
            "kvserve_decode_tps": engine_decode_tps, "foreign_cores": mon.foreign_cores}


# ---- the run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace, make_engine: EngineFactory = default_engine, hf_model: Any = None,
        ids: Sequence[int] | None = None, on_section: Callable[[dict[str, Any]], None] = lambda r: None
        ) -> dict[str, Any]:
    """Every section not in ``args.skip``; ``make_engine`` builds each engine, ``hf_model`` is the
    transformers model of the peer (None: the default model's), ``ids`` the text (None: pydoc's);
    ``on_section(result so far)`` after each section (a long run keeps what it measured)."""
    skip = set(args.skip.split(",")) if args.skip else set()
    result: dict[str, Any] = {"args": vars(args), "machine": {**machine_info(), "cpu": cpu_model()},
                              "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    rows = policies(args.sinks, args.window, args.h2o_backend)
    sized = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    table: list[dict[str, Any]] = []
    teacher: dict[str, list[tuple[float, int]]] = {}
    if "table" not in skip:
        with CpuMonitor() as mon:
            for policy in rows:
                engine = make_engine(policy, max_num_batched_tokens=args.chunk, kv_gib=args.pool_gib, **sized)
                if ids is None:
                    ids = text_tokens(engine.tokenizer, args.tokens)
                forced, peak = teacher_forced(engine, ids)
                teacher[policy.label] = forced
                per_token = engine.capacity.bytes_per_token
                conc = max_concurrent(engine, args.request_tokens, args.step_tokens, args.max_num_seqs)
                table.append({"policy": asdict(policy), "bytes_per_token": per_token,
                              "peak_tokens_held": peak * engine.capacity.block_size,
                              "held_bytes_per_text_token": per_token * peak * engine.capacity.block_size / len(ids),
                              "concurrency": conc})
                print(f"  {policy.label}: done", flush=True)
                del engine
                gc.collect()
            ref = teacher[rows[0].label]
            base = score(ref, ref, args.score_from)["nll"]
            for row, policy in zip(table, rows):
                s = score(teacher[policy.label], ref, args.score_from)
                row.update(nll=s["nll"], nll_delta=s["nll"] - base, top1_vs_dense_fp32=s["top1"])
        result["table_foreign_cores"] = mon.foreign_cores
        # decode at N streams, all engines in lockstep (load falls on them alike)
        need = args.decode_prompt + args.decode_tokens + args.chunk
        engines = {p.label: make_engine(p, max_num_batched_tokens=args.step_tokens, max_model_len=args.max_model_len,
                                        max_num_seqs=args.streams,
                                        num_blocks=args.streams * math.ceil(need / BLOCK) + 4 * args.streams)
                   for p in rows}
        print(f"  decode: {args.streams} streams, {len(engines)} engines in lockstep", flush=True)
        vocab = next(iter(engines.values())).arch.vocab_size
        with CpuMonitor() as mon:
            rates = decode_rates(engines, args.streams, args.decode_prompt, args.decode_tokens, seed=args.seed,
                                 token_range=(min(100, vocab // 2), vocab))
        del engines
        gc.collect()
        for row, policy in zip(table, rows):
            row["decode_tps"] = rates[policy.label]
            row["decode_vs_dense_fp32"] = rates[policy.label] / rates[rows[0].label] if rates[rows[0].label] else None
        result["decode_foreign_cores"] = mon.foreign_cores
        result["text_tokens"] = len(ids)
    result["table"] = table
    on_section(result)

    streaming = rows[4]
    if "flat" not in skip:
        flat_policy = replace(streaming, window=args.flat_window, label=f"streaming {args.sinks} sinks + "
                              f"{args.flat_window} window")
        engine = make_engine(flat_policy, max_num_batched_tokens=args.step_tokens, kv_gib=args.flat_pool_gib, max_num_seqs=4,
                             max_model_len=args.max_model_len)
        result["flat"] = {"policy": asdict(flat_policy),
                          "rows": flatness(engine, args.flat_totals, args.flat_decode, engine.arch.vocab_size)}
        del engine
        gc.collect()
        on_section(result)

    if "peer" not in skip:
        reason = kvpress_missing() or (None if teacher else "the policy table was skipped (the peer compares to it)")
        if reason is None and args.chunk % BLOCK:
            reason = f"--chunk {args.chunk} is not a multiple of the block size {BLOCK}: the kept sets would differ"
        if reason is not None:
            result["peer"] = {"skipped": reason}
        else:
            if hf_model is None:
                from transformers import AutoModelForCausalLM

                from engine.loader import resolve_model_dir

                path, _ = resolve_model_dir(None)
                hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                                attn_implementation="sdpa").eval()
            print("  kvpress peer", flush=True)
            engine = make_engine(streaming, max_num_batched_tokens=args.chunk, kv_gib=args.pool_gib, **sized)
            with CpuMonitor():
                ours_tps = decode_rate(engine, ids, args.flat_decode)
            del engine
            gc.collect()
            labels = {f"{args.sinks} sinks + {args.window} window": rows[4].label,
                      f"{args.window} window, no sinks": rows[5].label}
            engine_rows = {k: teacher[v] for k, v in labels.items()}
            dense_nll = next(r["nll"] for r in table if r["policy"]["label"] == rows[0].label)
            result["peer"] = kvpress_peer(hf_model, ids, engine_rows, dense_nll, args.sinks, args.window,
                                          args.chunk, args.score_from, args.flat_decode, ours_tps)
            from importlib.metadata import version

            result["peer"]["versions"] = f"kvpress {version('kvpress')}, transformers {version('transformers')}"
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


# ---- printing --------------------------------------------------------------------------------------
def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(result: dict[str, Any]) -> str:
    a, m = result["args"], result["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['threads']} threads), "
             f"transformers {m['transformers']}; load average before {result['loadavg_before']}, after "
             f"{result.get('loadavg_after')}"]
    if result["table"]:
        lines += ["", f"Text: {result['text_tokens']} tokens of pydoc_data.topics in {a['chunk']}-token chunks, "
                      f"scored from {a['score_from']}; concurrency: {a['request_tokens']}-token requests in a "
                      f"{a['pool_gib']} GiB pool (steps of {a['step_tokens']} tokens, max_num_seqs "
                      f"{a['max_num_seqs']}); decode: {a['streams']} streams of {a['decode_prompt']}-token prompts, "
                      f"{a['decode_tokens']} tokens each, engines in lockstep. Other processes used "
                      f"{result.get('table_foreign_cores')} cores during the quality runs, "
                      f"{result.get('decode_foreign_cores')} during decode.", "",
                  "| policy | KV dtype | NLL | delta vs dense fp32 | top-1 vs dense fp32 | pool bytes/token "
                  "| peak tokens held | KV bytes held / text token | concurrent 8k requests (derived) "
                  f"| decode tok/s, {a['streams']} streams | vs dense fp32 |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["table"]:
            c = r["concurrency"]
            conc = f"{'>=' if c['capped'] else ''}{c['verified']} ({c['derived']})"  # capped: max_num_seqs
            lines.append(f"| {r['policy']['label']} | {r['policy']['kv_dtype']} | {r['nll']:.4f} | "
                         f"{r['nll_delta']:+.4f} | {r['top1_vs_dense_fp32']:.4f} | {r['bytes_per_token']:,} | "
                         f"{r['peak_tokens_held']:,} | {r['held_bytes_per_text_token']:,.0f} | {conc} | "
                         f"{r['decode_tps']:.1f} | {_f(r['decode_vs_dense_fp32'], '.2f')}x |")
    if "flat" in result:
        f = result["flat"]
        lines += ["", f"Streaming flatness: {f['policy']['label']}, one stream, decode tok/s over the last "
                      f"{a['flat_decode']} tokens:", "",
                  "| total tokens | streaming tok/s | vs first | dense (kv_eviction false) | other processes, cores |",
                  "|---:|---:|---:|---|---:|"]
        first = f["rows"][0]["streaming_tps"]
        for r in f["rows"]:
            dense = r["dense_tps"] if isinstance(r["dense_tps"], str) else f"{r['dense_tps']:.1f} tok/s"
            lines.append(f"| {r['total_tokens']:,} | {r['streaming_tps']:.1f} | {r['streaming_tps'] / first:.2f}x "
                         f"| {dense} | {r['foreign_cores']} |")
    if "peer" in result:
        p = result["peer"]
        if "skipped" in p:
            lines += ["", f"kvpress peer: skipped ({p['skipped']})"]
        else:
            lines += ["", f"kvpress peer ({p['versions']}), same text and chunks; deltas against each side's own "
                          f"dense run (transformers fp32 {p['hf_dense_nll']:.4f}):", "",
                      "| kept set | kvpress NLL | kvpress delta | kvserve NLL | kvserve delta | top-1 kvserve vs kvpress |",
                      "|---|---:|---:|---:|---:|---:|"]
            for r in p["rows"]:
                lines.append(f"| {r['policy']} | {r['kvpress_nll']:.4f} | {r['kvpress_delta']:+.4f} | "
                             f"{r['kvserve_nll']:.4f} | {r['kvserve_delta']:+.4f} | {r['top1_kvserve_vs_kvpress']:.4f} |")
            lines += ["", f"single-stream decode after the text, sinks + window: kvpress {p['kvpress_decode_tps']:.1f} "
                          f"tok/s, kvserve {p['kvserve_decode_tps']:.1f} tok/s "
                          f"({p['kvserve_decode_tps'] / p['kvpress_decode_tps']:.2f}x)"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="text tokens teacher-forced")
    p.add_argument("--score-from", type=int, default=512)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk of the quality runs")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="of the pool's engines (int4's residual holds one open block each) and the concurrency cap")
    p.add_argument("--pool-gib", type=float, default=1.0, help="the fixed pool of the quality and concurrency runs")
    p.add_argument("--request-tokens", type=int, default=8192, help="concurrency: tokens per request")
    p.add_argument("--step-tokens", type=int, default=512,
                   help="max_num_batched_tokens of the admission, decode and flatness engines (the default's)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--decode-prompt", type=int, default=384)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--flat-window", type=int, default=1024)
    p.add_argument("--flat-totals", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--flat-decode", type=int, default=64)
    p.add_argument("--flat-pool-gib", type=float, default=0.5)
    p.add_argument("--h2o-backend", default=H2O_BACKEND, help="attention backend of the h2o row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of table, flat, peer")
    p.add_argument("--json", default=None, help="also write the result here")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    if args.tokens >= args.max_model_len:
        raise SystemExit("--tokens must be below --max-model-len: the dense rows hold the whole text")
    def save(result: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2, default=str)

    result = run(args, on_section=save)
    save(result)
    print(markdown(result))


if __name__ == "__main__":
    main()
