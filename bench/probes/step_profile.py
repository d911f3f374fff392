"""Where an engine step's time goes: the step's pieces timed in-thread, no HTTP.

    python -m bench.probes.step_profile [--streams 1 16] [--tokens 128] [--prompt-len 50] [kvserve engine flags]

Builds one ``LLMEngine`` from the engine flags (``--num-threads``, ``--activation-quant``,
``--decode-path``, ``--model``...), then for each stream count runs an untimed warm-up round and a
timed round of ``streams`` greedy requests (``--prompt-len``-token prompts, ``--tokens`` output
tokens, ``ignore_eos``) stepped to the end. Prints ms per step for the whole step and for each
piece, which it times by wrapping the methods that do it: the model's forward pass (and inside it
the native decoder layers and the embedding), the LM head, the sampler, the runner's input
preparation, and the scheduler's planning and update. The prefill step is included in the
averages (one step of ``tokens``).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from bench.step_timing import PIECES, instrumented


def run_round(engine: Any, streams: int, prompt_len: int, tokens: int, tag: str) -> tuple[int, float]:
    from kvtypes.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for s in range(streams):
        engine.add_request([100 + s + i for i in range(prompt_len)], params, request_id=f"{tag}-{s}")
    steps, t = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t


def profile(engine: Any, streams_levels: list[int], prompt_len: int, tokens: int) -> list[dict[str, Any]]:
    """One row per stream count: steps, ms per step, and ms per step of each piece that ran."""
    rows = []
    with instrumented(engine) as (seconds, calls):
        for streams in streams_levels:
            run_round(engine, streams, prompt_len, tokens, f"warm{streams}")
            seconds.clear()
            calls.clear()
            steps, elapsed = run_round(engine, streams, prompt_len, tokens, f"run{streams}")
            rows.append({"streams": streams, "steps": steps, "step_ms": 1000 * elapsed / steps,
                         "pieces": {label: (1000 * seconds[label] / steps, calls[label])
                                    for label, _, _ in PIECES if calls[label]}})
    return rows


def main(argv: list[str] | None = None) -> int:
    from kvserve.cli import add_engine_args, build_engine_config

    p = argparse.ArgumentParser(prog="python -m bench.probes.step_profile", description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=50)
    args = p.parse_args(argv)
    config, _ = build_engine_config(args)
    from engine.llm_engine import LLMEngine

    for row in profile(LLMEngine(config), args.streams, args.prompt_len, args.tokens):
        print(f"\n{row['streams']} stream(s): {row['steps']} steps, {row['step_ms']:.2f} ms/step "
              f"(activation_quant={config.model.activation_quant}, threads={config.model.num_threads})")
        for label, (ms, n) in row["pieces"].items():
            print(f"  {label:18s} {ms:8.3f} ms/step  ({n} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
