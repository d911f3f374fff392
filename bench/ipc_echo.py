"""The engine core's per-step message and its echo round trip over a ``multiprocessing`` pipe.

The core sends one message per step (each running request's new token ids and finish state, plus
one stats snapshot) over the pipe ``engine/core/process_client.py`` opens; ``pipe_round_trip_us``
times the echo of such a message to a spawned process (the ``roofline`` scenario's IPC column;
``bench.probes.ipc_transport`` compares it with other transports).
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any, Callable


def step_message(num_requests: int = 32) -> tuple:
    outputs = [(f"cmpl-{i:032x}-0", [1000 + i], None, None, 192, 1 + i % 64, 0) for i in range(num_requests)]
    stats = (num_requests, 0, 412, 6592, 0, 0, 0, 0.021, 2)
    return (outputs, stats)


def pipe_echo(conn: Any, raw: bool) -> None:
    while True:
        if raw:
            data = conn.recv_bytes()
            if data == b"stop":
                return
            conn.send_bytes(data)
        else:
            obj = conn.recv()
            if obj == "stop":
                return
            conn.send(obj)


def median_round_trip_us(roundtrip: Callable[[], None], rounds: int) -> float:
    """Median microseconds of ``roundtrip()`` over ``rounds`` calls, after up to 100 untimed ones."""
    for _ in range(min(100, rounds)):
        roundtrip()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        roundtrip()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def pipe_round_trip_us(num_requests: int = 32, rounds: int = 2000, timeout_s: float = 60.0) -> float:
    """Median echo round trip (us) of one ``num_requests``-request step message over a
    ``multiprocessing`` pipe with pickle, the transport ``engine/core/process_client.py`` uses,
    to a spawned process (the core sends one such message per step, one way: about half this)."""
    ctx = mp.get_context("spawn")
    msg = step_message(num_requests)
    a, b = ctx.Pipe()
    proc = ctx.Process(target=pipe_echo, args=(b, False), daemon=True)
    proc.start()
    try:
        a.send(msg)
        if not a.poll(timeout_s):  # a child that died (e.g. a __main__ without its guard) never answers
            raise RuntimeError(f"the echo process did not answer in {timeout_s:g} s (exit code {proc.exitcode})")
        a.recv()
        return median_round_trip_us(lambda: (a.send(msg), a.recv()), rounds)
    finally:
        if proc.is_alive():
            a.send("stop")
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
