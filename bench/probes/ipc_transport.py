"""Round-trip cost of one engine-step message between two processes, per transport.

The engine core sends one message per step: each running request's new token ids and
finish state plus one stats snapshot. This measures the echo round trip of such a message
(32 requests) for the candidate transports, so the choice in ``engine/core/client.py`` is
made on numbers: ``python -m bench.probes.ipc_transport`` (pyzmq and msgspec are optional; a
transport whose package is missing is skipped).
"""
from __future__ import annotations

import multiprocessing as mp
import pickle
import statistics
import time
from typing import Any, Callable

ROUNDS = 2000


def step_message(num_requests: int = 32) -> tuple:
    outputs = [(f"cmpl-{i:032x}-0", [1000 + i], None, None, 192, 1 + i % 64, 0) for i in range(num_requests)]
    stats = (num_requests, 0, 412, 6592, 0, 0, 0, 0.021, 2)
    return (outputs, stats)


def _pipe_echo(conn: Any, raw: bool) -> None:
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


def _zmq_echo(addr: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(addr)
    while True:
        data = sock.recv(copy=False)
        if data.bytes == b"stop":
            return
        sock.send(data, copy=False)


def _time(roundtrip: Callable[[], None], rounds: int = ROUNDS) -> float:
    for _ in range(min(100, rounds)):
        roundtrip()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        roundtrip()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def pipe_round_trip_us(num_requests: int = 32, rounds: int = ROUNDS, timeout_s: float = 60.0) -> float:
    """Median echo round trip (us) of one ``num_requests``-request step message over a
    ``multiprocessing`` pipe with pickle, the transport ``engine/core/process_client.py`` uses,
    to a spawned process (the core sends one such message per step, one way: about half this)."""
    ctx = mp.get_context("spawn")
    msg = step_message(num_requests)
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_pipe_echo, args=(b, False), daemon=True)
    proc.start()
    try:
        a.send(msg)
        if not a.poll(timeout_s):  # a child that died (e.g. a __main__ without its guard) never answers
            raise RuntimeError(f"the echo process did not answer in {timeout_s:g} s (exit code {proc.exitcode})")
        a.recv()
        return _time(lambda: (a.send(msg), a.recv()), rounds)
    finally:
        if proc.is_alive():
            a.send("stop")
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ctx = mp.get_context("spawn")
    msg = step_message()
    results: dict[str, float] = {}

    try:
        import msgspec
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    except ImportError:
        msgspec = None

    for raw in (False, True):
        if raw and msgspec is None:
            continue
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_pipe_echo, args=(b, raw), daemon=True)
        proc.start()
        if raw:
            results["pipe + msgspec msgpack"] = _time(lambda: (a.send_bytes(enc.encode(msg)), dec.decode(a.recv_bytes())))
            a.send_bytes(b"stop")
        else:
            results["pipe + pickle"] = _time(lambda: (a.send(msg), a.recv()))
            a.send("stop")
        proc.join()

    try:
        import zmq
    except ImportError:
        zmq = None
    if zmq is not None:
        addr = f"ipc:///tmp/kvserve-ipc-bench-{time.time_ns()}"
        sock = zmq.Context().socket(zmq.PAIR)
        sock.bind(addr)
        proc = ctx.Process(target=_zmq_echo, args=(addr,), daemon=True)
        proc.start()
        results["zmq ipc + pickle"] = _time(
            lambda: (sock.send(pickle.dumps(msg, protocol=5)), pickle.loads(sock.recv())))
        if msgspec is not None:
            results["zmq ipc + msgspec msgpack"] = _time(lambda: (sock.send(enc.encode(msg)), dec.decode(sock.recv())))
        sock.send(b"stop")
        proc.join()

    print(f"echo round trip of one 32-request step message, median of {ROUNDS}:")
    for name, us in results.items():
        print(f"  {name:28s} {us:7.1f} us")


if __name__ == "__main__":
    main()
