"""A prefix hit's step on each path: the native decode path (each chunk token a row of the decode
kernel) against the Python layers (the prefill chunk's attention kernel), in process.

    python -m bench.probes.chunk_path [--contexts 128 512 1000 3000] [--new 4 8 16 32 64]
                                      [--sequences 1] [--rounds 6] [--num-threads 2] [--model M]

Per context length a prompt of random token ids is prefilled once (prefix caching keeps its
whole blocks); then each timed request repeats it with ``new`` fresh tokens and one output
token, so its one step computes the uncached tail (``rows``: the new tokens and the prompt's last
partial block) over the cached context: what a chat turn after a long system prompt costs.
``--sequences`` such requests arrive together (one step of that many chunks, as speculative
verify rows of several streams are). The two paths alternate request by request, forced through
``NativeDecoder``'s limits, and each row prints their medians and which one the engine's rule
(``NativeDecoder.chunks_fit``) picks. What ``NativeDecoder.tiles_chunk_*`` were set from.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

UNLIMITED = 1 << 40


def _step_ms(engine: Any, prompts: list[list[int]], tag: str) -> float:
    from kvtypes.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=f"{tag}-{i}")
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def compare_chunk_paths(engine: Any, contexts: list[int], news: list[int], sequences: int = 1, rounds: int = 6,
                        seed: int = 0) -> list[dict[str, Any]]:
    """One row per (context, new): rows computed per sequence, (query, key) pairs, median ms on
    each path, the rule's choice, and whether the forced sides ran as forced (past ``max_rows``
    the native side runs the Python layers too). The paths' outputs are not compared here:
    tests/engine/model/test_native_decode.py holds them equal."""
    from engine.attention import PrefillChunk

    native = engine.runner.model.native
    if native is None:
        raise ValueError("the native decode path is not in use (decode_path python, or it cannot run here)")
    saved = (native.max_chunk_attention, native.tiles_prefill)
    block, vocab = engine.config.cache.block_size, engine.runner.model.arch.vocab_size
    rng = random.Random(seed)
    token = lambda: rng.randrange(3, vocab)  # noqa: E731
    rows, n = [], 0
    took: list[bool] = []  # per chunk step: whether the native path took every row of it
    rows_of = native.rows

    def spy(meta: Any, kv_caches: Any) -> int:
        taken = rows_of(meta, kv_caches)
        if meta.prefills:
            took.append(taken == meta.slot_mapping.shape[0])
        return taken

    native.rows = spy
    try:
        for ctx in contexts:
            prefix = [token() for _ in range(ctx)]
            _step_ms(engine, [prefix + [token()]], f"fill-{ctx}")
            for new in news:
                times: dict[str, list[float]] = {"native": [], "python": []}
                native_took: dict[str, list[bool]] = {"native": [], "python": []}
                for r in range(rounds):
                    for path in (("python", "native") if r % 2 == 0 else ("native", "python")):
                        native.max_chunk_attention = UNLIMITED if path == "native" else 0
                        native.tiles_prefill = False
                        n += 1
                        took.clear()
                        ms = _step_ms(engine, [prefix + [token() for _ in range(new)] for _ in range(sequences)],
                                           f"{path}-{n}")
                        times[path].append(ms)
                        native_took[path] += took
                native.max_chunk_attention, native.tiles_prefill = saved
                computed = new + ctx % block  # the prompt's last partial block is not cached
                chunks = [PrefillChunk(0, computed, ctx + new, None, None)] * sequences
                rows.append({"context": ctx, "new": new, "sequences": sequences, "rows": computed,
                             "pairs": computed * (ctx + new) * sequences,
                             "native_ms": statistics.median(times["native"]),
                             "python_ms": statistics.median(times["python"]),
                             "rule": "native" if native.chunks_fit(chunks) else "python",
                             # past max_rows the forced native side ran the Python layers too
                             "native_ran": all(native_took["native"]) and not any(native_took["python"])})
    finally:
        native.max_chunk_attention, native.tiles_prefill = saved
        del native.rows
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1000, 3000])
    parser.add_argument("--new", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="a GGUF file or checkpoint folder (default: the default model)")
    args = parser.parse_args(argv)
    from bench.engine_runs import load_engine

    engine = load_engine(args.model, args.num_threads, max_model_len=max(args.contexts) + max(args.new) + 64)
    native = engine.runner.model.native
    print(f"tiles_prefill {native.tiles_prefill}; rule: native while the step's pairs <= {native.max_chunk_attention}"
          + (f" and no chunk has both > {native.tiles_chunk_rows} rows and > {native.tiles_chunk_attention} pairs"
             if native.tiles_prefill else ""))
    print("context  new  seqs  rows    pairs  native ms  python ms  native/python  rule")
    for row in compare_chunk_paths(engine, args.contexts, args.new, args.sequences, args.rounds):
        print(f"{row['context']:7d} {row['new']:4d} {row['sequences']:5d} {row['rows']:5d} {row['pairs']:8d} "
              f"{row['native_ms']:10.1f} {row['python_ms']:10.1f} {row['native_ms'] / row['python_ms']:14.2f}  "
              f"{row['rule']}" + ("" if row["native_ran"] else "  (past max_rows: Python both)"),
              flush=True)


if __name__ == "__main__":
    main()
