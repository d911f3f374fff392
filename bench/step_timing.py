"""An engine step's pieces timed in-thread by wrapping the methods that do them.

* ``instrumented``: within a ``with`` block each piece's method (``PIECES``) on its owner is a timed
  wrapper adding to the yielded ``(seconds, calls)``; leaving the block puts the originals back;
* ``decode_profile``: pure decode steps at each of several row counts, mean ms per step and per
  piece, and ``other`` (the step less its top-level pieces); the best of a few rounds.

The suite's ``roofline`` scenario and the ``bench.probes.step_profile`` probe both use them.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Callable, Iterator

PIECES = (  # (label, owner attribute path, method)
    ("model forward", "runner.model", "forward"),
    ("  native layers", "runner.model", "native_decode"),
    ("  embedding", "runner.model", "embed_tokens"),
    ("LM head", "runner.model", "compute_logits"),
    ("sampler", "runner", "sampler"),
    ("prepare inputs", "runner", "prepare_inputs"),
    ("schedule", "scheduler", "schedule"),
    ("scheduler update", "scheduler", "update"),
)


@contextlib.contextmanager
def instrumented(engine: Any) -> Iterator[tuple[dict[str, float], collections.Counter]]:
    """Within the block each piece's method on its owner instance is a timed wrapper adding to
    the yielded ``(seconds, calls)`` per label; on leaving, the originals are put back (the
    engine is then as it was)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(label: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1
        return wrapper

    undo: list[tuple[Any, str, bool, Any]] = []
    for label, path, method in PIECES:
        owner = engine
        for part in path.split("."):
            owner = getattr(owner, part)
        undo.append((owner, method, method in vars(owner), vars(owner).get(method)))
        setattr(owner, method, timed(label, getattr(owner, method)))

    try:
        yield seconds, calls
    finally:
        for owner, method, own, value in reversed(undo):
            if own:
                setattr(owner, method, value)
            else:
                delattr(owner, method)


def top_level(label: str) -> bool:
    """Pieces that do not run inside another piece (their times add up to at most the step)."""
    return not label.startswith(" ")


def decode_round(engine: Any, streams: int, prompt_len: int, tokens: int, tag: str,
                 seconds: dict[str, float]) -> dict[str, Any]:
    """``streams`` greedy requests stepped to the end; only the steps that start with every
    request past its first token (pure decode steps of ``streams`` rows, as they all generate
    ``tokens`` tokens) are counted: their count, mean ms per step and each piece's mean ms
    (from ``seconds``, which ``instrumented``'s wrappers fill)."""
    from kvtypes.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for s in range(streams):
        engine.add_request([100 + s + i for i in range(prompt_len)], params, request_id=f"{tag}-{s}")
    started: set[str] = set()
    steps, total = 0, 0.0
    pieces: dict[str, float] = collections.defaultdict(float)
    while engine.has_unfinished():
        decoding = len(started) == streams
        before = dict(seconds)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        started.update(o.request_id for o in outs if o.new_token_ids)
        if decoding:
            steps += 1
            total += dt
            for label, value in seconds.items():
                pieces[label] += value - before.get(label, 0.0)
    if not steps:
        raise ValueError(f"no pure decode step at {streams} streams: ask for more than {tokens} tokens")
    return {"rows": streams, "decode_steps": steps, "step_ms": 1000 * total / steps,
            "pieces_ms": {label: 1000 * pieces[label] / steps for label, _, _ in PIECES if pieces.get(label)}}


def decode_profile(engine: Any, rows_levels: list[int], prompt_len: int, tokens: int,
                   rounds: int = 3) -> list[dict[str, Any]]:
    """``decode_round`` at each row count after an untimed warm-up round, ``rounds`` times, the
    engine instrumented for the duration only. Each row is the round with the lowest mean step
    (its pieces with it), as the bounds it is held against are the best of their runs: another
    process's load only slows a round. ``step_ms_rounds`` keeps every round's mean; ``other_ms`` is
    the step less its top-level pieces (the engine's own bookkeeping: outputs, detokenization,
    stats)."""
    rows = []
    with instrumented(engine) as (seconds, _):
        for n in rows_levels:
            decode_round(engine, n, prompt_len, max(4, tokens // 4), f"warm-decode{n}", seconds)
            runs = [decode_round(engine, n, prompt_len, tokens, f"decode{n}-{r}", seconds)
                    for r in range(max(1, rounds))]
            row = min(runs, key=lambda run: run["step_ms"])
            row["step_ms_rounds"] = [round(run["step_ms"], 3) for run in runs]
            row["other_ms"] = row["step_ms"] - sum(v for k, v in row["pieces_ms"].items() if top_level(k))
            rows.append(row)
    return rows
