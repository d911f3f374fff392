"""int8 and int4 KV: quality, decode speed and concurrency against the model's own-dtype (fp32) KV.

``teacher_forced(engine, tokens, chunk)`` runs ``tokens`` through an engine's model in prefill
chunks of ``chunk`` tokens (each chunk attends to the earlier ones through the paged pool, so
with int8 KV it reads dequantized blocks) and returns each position's log-probabilities of the
next token. ``compare`` gives the top-1 agreement and the mean NLL delta of two such runs.

Three measurements, one command each (the default model, SmolLM2-135M-Instruct):

    python -m bench.probes.kv_int8 [quality] [--tokens 2000] [--chunk 256]
        fp32 vs int8 KV (per-token-per-head scales, what --kv-cache-dtype int8 stores), vs
        fp16 KV (--kv-cache-dtype float16), vs int4 KV (--kv-cache-dtype int4, KIVI), and the
        KIVI alternative measured by simulation: keys with per-CHANNEL scales over each block's
        tokens, values per token (``--no-kivi`` skips it).
    python -m bench.probes.kv_int8 decode [--streams 16] [--rounds 2] [--configs "fp16 native,int4 native"]
        decode tokens/s at 16 streams: fp32 (native kernel), int8 (native kernel), int8 (torch
        path), fp16 and int4 (native kernels), the engines stepping in lockstep so machine load
        hits them alike (``--configs``: a subset; each engine holds a copy of the model).
    python -m bench.probes.kv_int8 concurrency [--budget-gib 0.05] [--requests 160]
        the same KV byte budget in fp32 and int8: requests running at once over a mixed workload
        submitted at once: the median over the steps where the pool was full (the next waiting
        prompt did not fit), the median while others queued, and the peak.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from engine.kv.pool import kv_bytes_per_token
from kvtypes.sampling_params import SamplingParams
from scheduler.output import ScheduledRequest
from scheduler.request import Request

# The fixed text both quality probes teacher-force (this one and activation_quant): a frozen copy of
# the bench's former shared-helpers module, the text the agreement numbers in the docs were measured on.
FIXED_TEXT = Path(__file__).with_name("fixed_text.txt")


@torch.inference_mode()
def teacher_forced(engine: Any, tokens: list[int], chunk: int) -> torch.Tensor:
    """``[len(tokens) - 1, vocab]`` log-probabilities of the next token at each position."""
    request = Request("teacher-forced", list(tokens), SamplingParams(max_tokens=1), max_tokens=1)
    out = []
    try:
        while request.num_computed_tokens < len(tokens):
            n = min(chunk, len(tokens) - request.num_computed_tokens)
            if engine.kv_cache.allocate_slots(request, n) is None:
                raise ValueError("the KV pool cannot hold the text")
            item = ScheduledRequest(request, n, engine.kv_cache.get_block_ids(request.request_id))
            input_ids, positions, meta = engine.runner.prepare_inputs([item])
            hidden = engine.runner.model(input_ids, positions, meta, engine.runner.kv_caches)
            out.append(torch.log_softmax(engine.runner.model.compute_logits(hidden).float(), dim=-1))
            request.num_computed_tokens += n
    finally:
        engine.kv_cache.free(request.request_id)
    return torch.cat(out)[:-1]


def compare(reference: torch.Tensor, other: torch.Tensor, tokens: list[int]) -> dict[str, float]:
    target = torch.tensor(tokens[1:])
    agree = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    nll_ref = -reference.gather(1, target[:, None]).mean().item()
    nll_other = -other.gather(1, target[:, None]).mean().item()
    return {"top1_agreement": agree, "nll_reference": nll_ref, "nll_int8": nll_other,
            "nll_delta": nll_other - nll_ref}


KIVI_WARNING = "simulated: fp32 pool, each written block re-quantized from an exact shadow copy"


def kivi_hook(keys: str):
    """A ``write_kv`` replacement for the torch backend that stores fake-quantized K/V in an fp32
    pool: values per token and head (as kv_quant), keys per token and head (``keys="token"``, the
    shipped scheme, a cross-check of the simulation) or per channel over the block's tokens
    (``keys="channel"``, KIVI's key layout with the block as its token group). Each write
    re-quantizes the touched blocks from an exact shadow copy, so a block is never quantized twice."""
    from engine.kv.int8 import dequantize, quantize

    shadows: dict[int, torch.Tensor] = {}

    def per_token(x: torch.Tensor) -> torch.Tensor:
        return dequantize(*quantize(x), torch.float32)

    def per_channel(x: torch.Tensor) -> torch.Tensor:  # [blocks, block_size, heads, d]: range over dim 1
        codes, scale = quantize(x.transpose(1, 3))
        return dequantize(codes, scale, torch.float32).transpose(1, 3)

    def store(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, fake) -> None:
        shadow = shadows.setdefault(id(cache), torch.zeros_like(cache))
        shadow.view(-1, *x.shape[1:]).index_copy_(0, slots, x)
        blocks = torch.unique(slots // cache.shape[1])
        cache[blocks] = fake(shadow[blocks])

    def write_kv(k_cache, v_cache, k, v, slot_mapping):
        store(k_cache, k, slot_mapping, per_channel if keys == "channel" else per_token)
        store(v_cache, v, slot_mapping, per_token)

    return write_kv


def bytes_per_token(arch, scheme: str, block_size: int) -> int:
    """Pool bytes per token: fp32, int8 per-token scales (2 floats per token and head, K and V),
    int8 with per-channel key scales (2 floats per channel, head and block, shared by its tokens)."""
    L, H, D = arch.num_layers, arch.num_kv_heads, arch.head_dim
    stored = {"fp32": "auto", "fp16": "float16", "token": "int8", "int4": "int4"}  # what --kv-cache-dtype stores
    if scheme in stored:
        return kv_bytes_per_token(L, H, D, stored[scheme], torch.float32, block_size)
    # simulated only: values per token as int8 stores them, keys' ranges per channel and block
    return kv_bytes_per_token(L, H, D, "int8", torch.float32) // 2 + L * H * (D + 8 * D // block_size)


def quality(args) -> None:
    from engine.attention import torch_sdpa

    text = FIXED_TEXT.read_text() * 4
    results, arch, tokens = {}, None, []
    runs = [("fp32", "auto", None), ("int8", "int8", None), ("float16", "float16", None), ("int4", "int4", None)]
    if args.kivi:
        if args.chunk % 16:
            raise SystemExit("--chunk must be a multiple of the block size (16) for the per-channel simulation")
        runs += [("sim per-token keys", "auto", "token"), ("sim per-channel keys (KIVI)", "auto", "channel")]
    for label, kv, keys in runs:
        engine = _engine(kv, "torch", args.num_threads, num_blocks=(args.tokens + 64) // 16 + 1)
        arch = engine.arch
        tokens = engine.tokenizer(text)["input_ids"][:args.tokens]
        original = torch_sdpa.write_kv
        if keys is not None:
            torch_sdpa.write_kv = kivi_hook(keys)
        try:
            t0 = time.perf_counter()
            results[label] = teacher_forced(engine, tokens, args.chunk)
        finally:
            torch_sdpa.write_kv = original
        print(f"{label}: {time.perf_counter() - t0:.1f} s")
    print(f"{len(tokens)} tokens, chunk {args.chunk}, block 16 (simulations: {KIVI_WARNING})")
    schemes = {"int8": "token", "float16": "fp16", "int4": "int4", "sim per-token keys": "token", "sim per-channel keys (KIVI)": "channel"}
    full = bytes_per_token(arch, "fp32", 16)
    for label, scheme in schemes.items():
        if label in results:
            r = compare(results["fp32"], results[label], tokens)
            per = bytes_per_token(arch, scheme, 16)
            print(f"{label:30s} top-1 {r['top1_agreement']:.4%}  NLL delta {r['nll_delta']:+.5f} nats  "
                  f"{per} bytes/token ({full / per:.2f}x fp32)")


def _engine(kv: str, backend: str, num_threads: int | None, num_blocks: int | None = None,
            budget_gib: float | None = None, max_num_seqs: int = 256, loaded=None):
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from scheduler.config import SchedulerConfig

    kv = "float32" if kv == "auto" else kv  # this probe's "auto" is the fp32 reference (the CPU default is fp16)
    cache = (CacheConfig(num_blocks=num_blocks, kv_cache_dtype=kv) if num_blocks else
             CacheConfig(kv_cache_memory_gib=budget_gib, kv_cache_dtype=kv))
    return LLMEngine(EngineConfig(model=ModelConfig(num_threads=num_threads, max_model_len=4096,
                                                    attention_backend=backend),
                                  cache=cache, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)),
                     loaded or load_model(None, torch.float32))


def decode_rates(engines: dict, streams: int, prompt_len: int, output_len: int, seed: int,
                 token_range: tuple[int, int] = (100, 10000)) -> dict[str, float]:
    """Output tokens/s of each engine over its steps in which all ``streams`` requests only
    decoded (random prompts of ids in ``token_range``). The engines step in lockstep (one step each, in turn), so load from other processes
    on a shared machine falls on all of them alike."""
    import random

    from kvtypes.sampling_params import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(*token_range) for _ in range(prompt_len)] for _ in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for engine in engines.values():
        for p in prompts:
            engine.add_request(p, params)
    tokens = {label: 0 for label in engines}
    seconds = {label: 0.0 for label in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for label, engine in engines.items():
            if not engine.has_unfinished():
                continue
            sched = engine.scheduler
            decoding = (len(sched.running) == streams and not sched.waiting
                        and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running))
            t0 = time.perf_counter()
            engine.step()
            if decoding:
                seconds[label] += time.perf_counter() - t0
                tokens[label] += streams
    for engine in engines.values():
        engine.kv_cache.check_invariants()
    return {label: tokens[label] / seconds[label] if seconds[label] else 0.0 for label in engines}


def decode(args) -> None:
    import statistics

    from engine.loader import load_model

    configs = [("fp32 native", "auto", "native"), ("int8 native", "int8", "native"), ("int8 torch", "int8", "torch"),
               ("fp16 native", "float16", "native"), ("int4 native", "int4", "native")]
    if args.configs:  # a subset, e.g. "fp16 native,int4 native" (each engine holds its own model copy)
        configs = [c for c in configs if c[0] in args.configs.split(",")]
    engines = {label: _engine(kv, backend, args.num_threads, num_blocks=args.streams * 8 + 16,
                              loaded=load_model(None, torch.float32)) for label, kv, backend in configs}
    rates: dict[str, list[float]] = {label: [] for label in engines}
    for r in range(args.rounds):
        for label, rate in decode_rates(engines, args.streams, args.prompt_len, args.output_len, seed=r).items():
            rates[label].append(rate)
        print(f"round {r}: " + ", ".join(f"{label} {v[-1]:.1f} tok/s" for label, v in rates.items()), flush=True)
    base_label = next(iter(rates))
    base = statistics.median(rates[base_label])
    for label, values in rates.items():
        m = statistics.median(values)
        print(f"{label:12s} median {m:.1f} tok/s = {m / base:.3f}x {base_label}  (rounds: {', '.join(f'{v:.1f}' for v in values)})")


def concurrency(args) -> None:
    import random
    import statistics

    from bench.kv_memory import median_running_while_queued
    from kvtypes.sampling_params import SamplingParams

    rng = random.Random(0)
    workload = [([rng.randrange(100, 10000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
                 rng.randint(args.min_output, args.max_output)) for _ in range(args.requests)]
    out = {}
    for kv in ("auto", "int8"):
        engine = _engine(kv, "auto", args.num_threads, budget_gib=args.budget_gib, max_num_seqs=args.requests)
        for prompt, n in workload:
            engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        samples, full = [], []
        bs = engine.capacity.block_size
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            sched = engine.scheduler
            samples.append({"running": len(sched.running), "waiting": len(sched.waiting)})
            # The pool was the limit: the next waiting prompt did not fit in the free blocks (steps
            # where admission stopped at the step's token budget instead are left out).
            if sched.waiting and engine.kv_cache.num_free_blocks < -(-sched.waiting[0].num_tokens // bs):
                full.append(len(sched.running))
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
        out[kv] = (engine.capacity, median_running_while_queued(samples), max(s["running"] for s in samples),
                   statistics.median(full) if full else 0, len(full), engine.scheduler.stats.num_preemptions)
        cap = out[kv][0]
        print(f"{'fp32' if kv == 'auto' else 'int8'}: {cap.num_blocks} blocks = {cap.num_tokens} tokens in "
              f"{args.budget_gib} GiB ({cap.bytes_per_token} bytes/token); running: median while the pool was "
              f"full {out[kv][3]} ({out[kv][4]} of {len(samples)} steps), median while queued {out[kv][1]}, "
              f"peak {out[kv][2]}; preemptions {out[kv][5]}; {time.perf_counter() - t0:.0f} s", flush=True)
    fp32, int8 = out["auto"], out["int8"]
    ratio = lambda i: int8[i] / fp32[i] if fp32[i] else float("nan")  # noqa: E731
    print(f"int8 / fp32: tokens {int8[0].num_tokens / fp32[0].num_tokens:.2f}x; concurrency: median while the pool "
          f"was full {ratio(3):.2f}x, median while queued {ratio(1):.2f}x, peak {ratio(2):.2f}x (target >= 3.5x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", default="quality", choices=("quality", "decode", "concurrency"))
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=2000, help="quality: text length")
    parser.add_argument("--chunk", type=int, default=256, help="quality: prefill chunk")
    parser.add_argument("--no-kivi", dest="kivi", action="store_false", help="quality: skip the KIVI simulation")
    parser.add_argument("--streams", type=int, default=16, help="decode: concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=64, help="decode: prompt tokens per stream")
    parser.add_argument("--output-len", type=int, default=32, help="decode: output tokens per stream")
    parser.add_argument("--rounds", type=int, default=2, help="decode: interleaved rounds")
    parser.add_argument("--configs", default="", help="decode: comma-separated labels to run (default all)")
    parser.add_argument("--budget-gib", type=float, default=0.05, help="concurrency: KV bytes, both dtypes")
    parser.add_argument("--requests", type=int, default=160, help="concurrency: requests submitted at once")
    parser.add_argument("--min-prompt", type=int, default=24)
    parser.add_argument("--max-prompt", type=int, default=56)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=64)
    args = parser.parse_args()
    {"quality": quality, "decode": decode, "concurrency": concurrency}[args.mode](args)


if __name__ == "__main__":
    main()
