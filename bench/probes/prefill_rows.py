"""A prefill chunk's row ops, native (engine/kernels/cpu/prefill_rows.cpp) against torch's CPU
composites they replace (docs/benchmarks.md, "a ninth session"):

- each op alone on the same random tensors, alternated in one process: ``F.rms_norm``, the residual
  add and the norm after it, RoPE on q and k (``apply_rope_signed``), for ``rows:hidden:heads``
  shapes (heads: the q and k heads rotated, of 64);
- with ``--model`` (a path, or ``default``), whole prefills of ``--tokens`` random tokens through an engine at the defaults,
  its ``use_native_rows`` switched between prompts.

    python -m bench.probes.prefill_rows [--shapes 512:576:12 512:2048:40] [--rounds 30]
        [--model PATH --tokens 1000 --prefill-rounds 8] [--num-threads 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from bench.ipc_echo import median_round_trip_us as median_us
from bench.machine import set_threads

HEAD_DIM = 64
EPS = 1e-5


def run_row_ops(rows: int, hidden: int, heads: int, rounds: int = 30) -> dict[str, Any]:
    """Median µs of each op, native and torch, over ``rounds`` calls alternated in blocks of 5 (the
    best block's median), and each pair's largest output difference."""
    from engine.model.rope import apply_rope_signed

    gen = torch.Generator().manual_seed(rows + hidden)
    x, h = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    w = torch.rand(hidden, generator=gen) + 0.5
    qkv = torch.randn(rows, (heads + 2) * HEAD_DIM, generator=gen)
    angle = torch.rand(rows, HEAD_DIM // 2, generator=gen) * 100  # real rotations: repeated calls stay bounded
    cos = torch.cat([angle.cos(), angle.cos()], -1)
    sin = torch.cat([-angle.sin(), angle.sin()], -1)
    ops = torch.ops.kvserve

    def torch_rope(t: torch.Tensor = qkv) -> torch.Tensor:
        return apply_rope_signed(t[:, :heads * HEAD_DIM].view(rows, heads, HEAD_DIM), cos[:, None], sin[:, None])

    def native_rope(t: torch.Tensor = qkv) -> torch.Tensor:  # in place, as the layer calls it
        ops.rope_(t, cos, sin, heads)
        return t[:, :heads * HEAD_DIM].view(rows, heads, HEAD_DIM)

    # (native, torch, the same native call on fresh copies for the difference): the in-place ops are
    # timed in place, as the layer runs them, on tensors they keep rewriting
    pairs = {
        "rms_norm": (lambda: ops.rms_norm(x, w, EPS), lambda: F.rms_norm(x, (hidden,), w, EPS),
                     lambda: ops.rms_norm(x, w, EPS)),
        "add_rms_norm": (lambda: ops.add_rms_norm_(h, x, w, EPS), lambda: F.rms_norm(x + h, (hidden,), w, EPS),
                         lambda: ops.add_rms_norm_(h.clone(), x, w, EPS)),
        "rope": (native_rope, torch_rope, lambda: native_rope(qkv.clone())),
    }
    result: dict[str, Any] = {"rows": rows, "hidden": hidden, "heads": heads}
    for name, (native, reference, fresh) in pairs.items():
        diff = (fresh() - reference()).abs().max().item()
        native_us, torch_us = [], []
        for _ in range(max(1, rounds // 5)):
            native_us.append(median_us(native, 5))
            torch_us.append(median_us(reference, 5))
        result[name] = {"native_us": round(min(native_us), 1), "torch_us": round(min(torch_us), 1),
                        "max_abs_diff": diff}
    return result


def run_prefill_ab(engine: Any, tokens: int, rounds: int) -> dict[str, Any]:
    """Prefills of ``tokens`` random tokens (one output token, no prefix hit), ``native_rows`` on and
    off alternated (ABBA), ms per prefill for each."""
    from kvtypes.sampling_params import SamplingParams

    model = engine.runner.model
    was = model.native_rows
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(tokens)
    vocab = model.arch.vocab_size

    def prefill(tag: str) -> float:
        engine.add_request([rng.randrange(3, vocab) for _ in range(tokens)], params, request_id=tag)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return 1000 * (time.perf_counter() - start)

    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        prefill("warm")
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                model.use_native_rows(on)
                times[on].append(prefill(f"{r}-{on}"))
    finally:
        model.use_native_rows(was)
    return {"tokens": tokens, "rounds": rounds,
            **{("native" if on else "torch"): {"min_ms": round(min(t), 1), "median_ms": round(statistics.median(t), 1),
                                               "runs_ms": [round(v) for v in t]} for on, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["512:576:12", "512:2048:40"], help="rows:hidden:heads")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--model", help="also time whole prefills of this model (a path; 'default': kvserve's "
                                        "default model) at the defaults")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--prefill-rounds", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    threads = set_threads(args.num_threads)
    from engine.kernels import has_op

    if not has_op("add_rms_norm_"):
        raise SystemExit("the native kernels did not build here (see the log)")
    for shape in args.shapes:
        rows, hidden, heads = (int(v) for v in shape.split(":"))
        print(run_row_ops(rows, hidden, heads, args.rounds))
    if args.model:
        from engine.config import EngineConfig, ModelConfig
        from engine.llm_engine import LLMEngine

        model = None if args.model == "default" else args.model
        engine = LLMEngine(EngineConfig(model=ModelConfig(model=model, num_threads=threads)))
        print(run_prefill_ab(engine, args.tokens, args.prefill_rounds))


if __name__ == "__main__":
    main()
