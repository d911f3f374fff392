"""int8 activations (``--activation-quant int8``) against fp32 activations: agreement and speed.

    python -m bench.probes.activation_quant [quality] [--model PATH.gguf] [--tokens 2000] [--chunks 1 256]
        Teacher-forced top-1 agreement and mean NLL delta over a fixed text
        (``bench/probes/fixed_text.txt``, as bench.probes.kv_int8 uses), once per chunk size: chunks of 1 token per
        step are decode (every matmul call has one row and takes the int8 kernel where the flag
        is on, the same kernel as the native decode path; they differ only in fp32 summation
        order); chunks of 256 are prefill, which takes the int8 kernel too where BlockLinear's
        max_rows allows (AVX512-VNNI CPUs, Q4_1 and Q8_0), and fp32 activations elsewhere.
    python -m bench.probes.activation_quant defaults [--model PATH.gguf] [--tokens 2000] [--chunks 1 16 256]
        The same comparison of kvserve's CPU defaults (activation_quant auto: int8 on GGUF blocks;
        kv_cache_dtype auto: fp16 KV) against the exact flags (none, float32): the table of
        docs/configuration.md.
    python -m bench.probes.activation_quant speed [--model PATH.gguf] [--streams 1 16] [--steps 48]
        Decode steps of both engines in lockstep (one step each, in turn, so machine load hits
        them alike): median ms per all-decode step for each stream count.

Default model: SmolLM2-135M-Instruct (its Q4_1 GGUF layers, its Q8_0 tied LM head).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.probes.kv_int8 import FIXED_TEXT, compare, teacher_forced
from kvtypes.sampling_params import SamplingParams

MODES = ("none", "int8")
# (activation_quant, kv_cache_dtype) per side; the int8 comparison keeps fp32 KV on both
FLAGS = {"none": ("none", "float32"), "int8": ("int8", "float32"), "exact": ("none", "float32"),
         "defaults": ("auto", "auto")}


def _engine(mode: str, model: str | None, num_threads: int | None, num_blocks: int) -> Any:
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    activation_quant, kv_cache_dtype = FLAGS[mode]
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, num_threads=num_threads, max_model_len=4096, activation_quant=activation_quant),
        cache=CacheConfig(num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=64)))


def quality(args, modes: tuple[str, str] = MODES) -> None:
    text = FIXED_TEXT.read_text() * 4
    results: dict[tuple[str, int], torch.Tensor] = {}
    tokens: list[int] = []
    for mode in modes:
        engine = _engine(mode, args.model, args.num_threads, (args.tokens + 64) // 16 + 1)
        tokens = engine.tokenizer(text)["input_ids"][:args.tokens]
        for chunk in args.chunks:
            t0 = time.perf_counter()
            results[mode, chunk] = teacher_forced(engine, tokens, chunk)
            print(f"{mode} ({engine.config.model.activation_quant} activations, {engine.info.kv_cache_dtype} KV), "
                  f"{chunk} tokens per step: {time.perf_counter() - t0:.1f} s")
        del engine
    ref, other = modes
    for chunk in args.chunks:
        r = compare(results[ref, chunk], results[other, chunk], tokens)
        print(f"{len(tokens)} tokens teacher-forced, {chunk} per step: top-1 agreement {r['top1_agreement']:.4%}, "
              f"NLL {ref} {r['nll_reference']:.5f} {other} {r['nll_int8']:.5f} (delta {r['nll_delta']:+.5f} nats)")


def speed(args) -> None:
    engines = {mode: _engine(mode, args.model, args.num_threads, 64 * max(args.streams) + 64) for mode in MODES}
    for streams in args.streams:
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode, engine in engines.items():
            for c in range(streams):
                engine.add_request([100 + c + i for i in range(args.prompt_len)],
                                   SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True),
                                   request_id=f"{mode}-{streams}-{c}")
        while all(e.has_unfinished() for e in engines.values()):
            for mode, engine in engines.items():
                running = len(engine.scheduler.running) if hasattr(engine.scheduler, "running") else streams
                t = time.perf_counter()
                engine.step()
                if running == streams and not engine.scheduler.waiting:
                    times[mode].append(time.perf_counter() - t)
        for engine in engines.values():
            while engine.has_unfinished():
                engine.step()
        med = {mode: statistics.median(v[4:] or v) * 1e3 for mode, v in times.items()}
        print(f"{streams:3d} streams: fp32 activations {med['none']:.2f} ms/step, int8 {med['int8']:.2f} ms/step "
              f"({med['none'] / med['int8']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="quality", choices=["quality", "defaults", "speed"])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 256],
                        help="tokens per step of the teacher-forced runs (1: decode, 256: prefill)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=50)
    args = parser.parse_args()
    with torch.inference_mode():
        if args.what == "speed":
            speed(args)
        else:
            quality(args, MODES if args.what == "quality" else ("exact", "defaults"))


if __name__ == "__main__":
    main()
