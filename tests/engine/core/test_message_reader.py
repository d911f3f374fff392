"""``MessageReader`` reads what ``multiprocessing``'s ``Connection.send`` writes: whole messages in
order, however the bytes are split across reads (a header or a body cut anywhere), frames with
the 8-byte length form, messages larger than one read, and EOF at the pipe's end."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import struct
import threading

import pytest

from engine.core.protocol import MessageReader


def _pipe():
    recv, send = multiprocessing.Pipe(duplex=False)
    return recv, send


def _read_all(reader: MessageReader, count: int) -> list:
    got: list = []
    while len(got) < count:
        assert reader.poll(5.0), f"only {len(got)} of {count} messages arrived"
        got.extend(reader.read())
    return got


def test_messages_sent_by_connection_come_back_whole_and_in_order():
    recv, send = _pipe()
    reader = MessageReader(recv)
    messages = [{"step": i, "tokens": list(range(i % 7))} for i in range(200)]
    for m in messages:
        send.send(m)
    assert _read_all(reader, len(messages)) == messages


def test_frames_split_at_every_byte_are_reassembled():
    recv, send = _pipe()
    reader = MessageReader(recv)
    payloads = [pickle.dumps(("a", i, "é" * i)) for i in range(5)]
    # the 4-byte form, and the 8-byte form Connection uses beyond 2 GiB (crafted here small)
    frames = [struct.pack("!i", len(payloads[0])) + payloads[0],
              struct.pack("!i", -1) + struct.pack("!Q", len(payloads[1])) + payloads[1],
              *(struct.pack("!i", len(p)) + p for p in payloads[2:])]
    wire = b"".join(frames)
    ends = [sum(len(f) for f in frames[:k + 1]) for k in range(len(frames))]
    fd = send.fileno()
    got: list = []
    for i in range(len(wire)):  # one byte a read: every header and body is cut at every place
        os.write(fd, wire[i:i + 1])
        assert reader.poll(5.0)
        got.extend(reader.read())
        assert len(got) == sum(1 for end in ends if end <= i + 1)  # a message as soon as its last byte is in
    assert got == [pickle.loads(p) for p in payloads]


def test_a_message_larger_than_a_read_and_the_pipe_buffer():
    recv, send = _pipe()
    reader = MessageReader(recv)
    big = bytes(range(256)) * ((3 * MessageReader.READ_SIZE) // 256)
    writer = threading.Thread(target=lambda: (send.send(big), send.send("after")))
    writer.start()
    got = _read_all(reader, 2)
    writer.join()
    assert got == [big, "after"]


def test_end_of_pipe_raises_eof_after_the_last_message():
    recv, send = _pipe()
    reader = MessageReader(recv)
    send.send("last")
    send.close()
    assert reader.poll(5.0)
    assert reader.read() == ["last"]
    assert reader.poll(0)  # the end is readable too
    with pytest.raises(EOFError):
        reader.read()
