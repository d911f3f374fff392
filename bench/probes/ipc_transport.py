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
import time
from bench.ipc_echo import median_round_trip_us, pipe_echo, step_message

ROUNDS = 2000


def _zmq_echo(addr: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(addr)
    while True:
        data = sock.recv(copy=False)
        if data.bytes == b"stop":
            return
        sock.send(data, copy=False)


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
        proc = ctx.Process(target=pipe_echo, args=(b, raw), daemon=True)
        proc.start()
        if raw:
            results["pipe + msgspec msgpack"] = median_round_trip_us(
                lambda: (a.send_bytes(enc.encode(msg)), dec.decode(a.recv_bytes())), ROUNDS)
            a.send_bytes(b"stop")
        else:
            results["pipe + pickle"] = median_round_trip_us(lambda: (a.send(msg), a.recv()), ROUNDS)
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
        results["zmq ipc + pickle"] = median_round_trip_us(
            lambda: (sock.send(pickle.dumps(msg, protocol=5)), pickle.loads(sock.recv())), ROUNDS)
        if msgspec is not None:
            results["zmq ipc + msgspec msgpack"] = median_round_trip_us(
                lambda: (sock.send(enc.encode(msg)), dec.decode(sock.recv())), ROUNDS)
        sock.send(b"stop")
        proc.join()

    print(f"echo round trip of one 32-request step message, median of {ROUNDS}:")
    for name, us in results.items():
        print(f"  {name:28s} {us:7.1f} us")


if __name__ == "__main__":
    main()
