"""A prefix hit's step on each path: the native decode path, its chunk rows on the decode kernel
(each row re-reading its context) or on the AMX tiles, against the Python layers, in process.

    python -m bench.probes.chunk_path [--contexts 128 512 1000 3000] [--new 4 8 16 32 64]
                                      [--sequences 1] [--rounds 6] [--num-threads 2] [--model M]

Per context length a prompt of random token ids is prefilled once (prefix caching keeps its
whole blocks); then each timed request repeats it with ``new`` fresh tokens and one output
token, so its one step computes the uncached tail (``rows``: the new tokens and the prompt's last
partial block) over the cached context: what a chat turn after a long system prompt costs.
``--sequences`` such requests arrive together (one step of that many chunks, as speculative
verify rows of several streams are). The sides alternate request by request, forced through
``NativeDecoder``'s limits and ``DecodeStack.set_chunk_tiles`` (the tiles side only where the
CPU has them), and each row prints their medians and which path the engine's rule
(``NativeDecoder.chunks_fit``) picks. What ``NativeDecoder``'s limits were set from.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

UNLIMITED = 1 << 40
SIDES = ("kernel", "tiles", "python")  # the native path's rows on the decode kernel, on the tiles; the Python layers


def _step_ms(engine: Any, prompts: list[list[int]], tag: str) -> float:
    from kvtypes.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=f"{tag}-{i}")
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1e3


def _force(native: Any, side: str, tiles: bool) -> None:
    """The limits that send every chunk step to ``side``."""
    on_tiles = native.stack.set_chunk_tiles(side == "tiles" and tiles, native.tiles_chunk_rows)
    native.chunk_tiles = bool(on_tiles)
    native.max_chunk_attention = -1 if side == "python" else UNLIMITED
    native.tiles_step_rows = -1 if side == "python" else UNLIMITED


def compare_chunk_paths(engine: Any, contexts: list[int], news: list[int], sequences: int = 1, rounds: int = 6,
                        seed: int = 0) -> list[dict[str, Any]]:
    """One row per (context, new): rows computed per sequence, (query, key) pairs, median ms on
    each side (``tiles_ms`` None where the CPU has no tiles for them), the rule's choice
    (``native`` or ``python``), and whether every side ran as forced (past ``max_rows`` the native
    sides run the Python layers too). The paths' outputs are not compared here:
    tests/engine/model/test_native_decode.py holds them equal."""
    from engine.attention import PrefillChunk

    native = engine.runner.model.native
    if native is None:
        raise ValueError("the native decode path is not in use (decode_path python, or it cannot run here)")
    saved = (native.max_chunk_attention, native.tiles_step_rows, native.chunk_tiles)
    tiles = bool(native.stack.set_chunk_tiles(True, native.tiles_chunk_rows))
    sides = [side for side in SIDES if side != "tiles" or tiles]
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

    def restore() -> None:
        native.max_chunk_attention, native.tiles_step_rows, chunk_tiles = saved
        native.chunk_tiles = bool(native.stack.set_chunk_tiles(chunk_tiles, native.tiles_chunk_rows))

    native.rows = spy
    try:
        for ctx in contexts:
            prefix = [token() for _ in range(ctx)]
            _step_ms(engine, [prefix + [token()]], f"fill-{ctx}")
            for new in news:
                times: dict[str, list[float]] = {side: [] for side in sides}
                native_took: dict[str, list[bool]] = {side: [] for side in sides}
                for r in range(rounds):
                    for side in (sides if r % 2 == 0 else sides[::-1]):
                        _force(native, side, tiles)
                        n += 1
                        took.clear()
                        times[side].append(_step_ms(
                            engine, [prefix + [token() for _ in range(new)] for _ in range(sequences)], f"{side}-{n}"))
                        native_took[side] += took
                restore()
                computed = new + ctx % block  # the prompt's last partial block is not cached
                chunks = [PrefillChunk(0, computed, ctx + new, None, None)] * sequences
                rows.append({"context": ctx, "new": new, "sequences": sequences, "rows": computed,
                             "pairs": computed * (ctx + new) * sequences,
                             **{f"{side}_ms": statistics.median(times[side]) if side in times else None
                                for side in SIDES},
                             "rule": "native" if native.chunks_fit(chunks) else "python",
                             "as_forced": all(all(native_took[side]) for side in sides if side != "python")
                             and not any(native_took["python"])})
    finally:
        restore()
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
    print(f"chunk_tiles {native.chunk_tiles}; rule: the decode kernel's chunks to {native.max_chunk_attention} pairs"
          + (f", chunks of more than {native.tiles_chunk_rows} rows on the tiles to {native.tiles_step_rows} rows"
             if native.chunk_tiles else ""))
    print("context  new  seqs  rows    pairs  kernel ms  tiles ms  python ms  rule")
    for row in compare_chunk_paths(engine, args.contexts, args.new, args.sequences, args.rounds):
        tiles = "-" if row["tiles_ms"] is None else f"{row['tiles_ms']:.1f}"
        print(f"{row['context']:7d} {row['new']:4d} {row['sequences']:5d} {row['rows']:5d} {row['pairs']:8d} "
              f"{row['kernel_ms']:10.1f} {tiles:>9s} {row['python_ms']:10.1f}  {row['rule']}"
              + ("" if row["as_forced"] else "  (past max_rows: the Python layers on every side)"), flush=True)


if __name__ == "__main__":
    main()
