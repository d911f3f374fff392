"""The bench's streaming client (bench/client.py) against real HTTP servers: uvicorn serving a
small SSE app (chunked bodies, keep-alive, Content-Length errors), and a bare asyncio server for
the framings uvicorn does not send (a body read to the close, a connection dropped mid-stream)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any, AsyncIterator

import pytest

from bench.client import chat_request, completion_request, run_load, summarize
from bench.peers.base import Server
from bench.server import start_inprocess


def _sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    peers: list[int] = []  # the client port of every request: one per connection kept alive

    async def completions(request: Request) -> Any:
        peers.append(request.client.port)
        body = await request.json()
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        if body.get("temperature", 0) < 0:
            return JSONResponse({"error": {"message": "temperature must be >= 0"}}, status_code=400)
        n = body["max_tokens"]
        chat = request.url.path.endswith("/chat/completions")

        async def events() -> AsyncIterator[bytes]:
            if chat:  # the role chunk first, with no content: not a token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                await asyncio.sleep(0.002)
                if body.get("fail_at") == i:
                    yield _sse({"error": {"message": "engine fault", "type": "internal_error"}})
                    break
                piece = f"t{i} "
                yield _sse({"choices": [{"index": 0, "delta": {"content": piece}} if chat else
                                        {"index": 0, "text": piece}]})
            yield _sse({"choices": [], "usage": {"prompt_tokens": len(body.get("prompt", [])) or 7,
                                                 "completion_tokens": n, "total_tokens": n + 7,
                                                 "prompt_tokens_details": {"cached_tokens": 3}}})
            yield _sse(b"[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", completions, methods=["POST"]),
                            Route("/health", lambda r: PlainTextResponse("ok"))])
    app.state.peers = peers
    return app


@pytest.fixture(scope="module")
def sse_server() -> Any:
    app = _app()
    server = start_inprocess(app, "m")
    try:
        yield server, app.state.peers
    finally:
        server.close()


def test_streams_are_read_token_by_token(sse_server: Any) -> None:
    server, _ = sse_server
    records, elapsed = run_load(server, [completion_request([1, 2, 3, 4], 5), chat_request(
        [{"role": "user", "content": "hi"}], 4)], 2)
    done, chat = records
    assert (done.error, done.text, done.chunks, done.output_tokens, done.prompt_tokens, done.cached_tokens) == (
        None, "t0 t1 t2 t3 t4 ", 5, 5, 4, 3)
    assert (chat.error, chat.text, chat.chunks, chat.output_tokens) == (None, "t0 t1 t2 t3 ", 4, 4)
    for r in records:
        assert 0 < r.ttft_s < r.last_s <= r.e2e_s <= elapsed
        assert r.tpot_s == pytest.approx((r.last_s - r.ttft_s) / (r.output_tokens - 1))
    summary = summarize(records, elapsed)
    assert (summary["requests"], summary["errors"], summary["output_tokens"]) == (2, 0, 9)


def test_one_connection_per_worker_kept_alive_past_an_error(sse_server: Any) -> None:
    server, peers = sse_server
    peers.clear()
    bad = completion_request([1], 3, temperature=-1)
    records, _ = run_load(server, [bad, completion_request([1], 3), completion_request([2], 3), bad,
                                   completion_request([3], 3), completion_request([4], 3)], 2)
    errors = [r.error for r in records]
    assert errors[0].startswith("HTTP 400: ") and "temperature must be >= 0" in errors[0]
    assert errors[3] == errors[0] and errors[1:3] == [None, None] and errors[4:] == [None, None]
    assert [r.output_tokens for r in records] == [0, 3, 3, 0, 3, 3]
    assert len(peers) == 6 and len(set(peers)) == 2  # two workers, each on its own connection throughout


def test_an_error_chunk_ends_the_request_with_its_message(sse_server: Any) -> None:
    server, _ = sse_server
    records, _ = run_load(server, [completion_request([1], 6, fail_at=2), completion_request([1], 2)], 1)
    assert records[0].error == "engine fault" and records[0].text == "t0 t1 "
    assert records[1].error is None and records[1].text == "t0 t1 "


class _BareServer:
    """Responses on a bare socket, one request a connection: 'close' sends an HTTP/1.0 body with
    neither Content-Length nor chunks, read to the close; 'drop' closes mid-stream; 'keep' answers
    in HTTP/1.1 chunks as if the connection stayed open, then closes it when the next request comes
    (what llama-server's cpp-httplib does after its fifth request on a connection)."""

    def __init__(self) -> None:
        self.accepted = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                mode = json.loads(body)["mode"]
                if mode == "keep":  # HTTP/1.1, kept alive; the next request on it is dropped unanswered
                    events = _sse({"choices": [{"index": 0, "text": "k"}]}) + _sse(b"[DONE]")
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                                 b"%x\r\n" % len(events) + events + b"\r\n0\r\n\r\n")
                    conn.recv(65536)
                    continue
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
                conn.sendall(_sse({"choices": [{"index": 0, "text": "a"}]}))
                if mode == "close":
                    conn.sendall(_sse({"choices": [{"index": 0, "text": "b"}]}) +
                                 _sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}) +
                                 _sse(b"[DONE]"))
                else:  # a partial event, then the connection goes away
                    conn.sendall(b'data: {"choices": [{"ind')

    def close(self) -> None:
        self.sock.close()


def test_bodies_read_to_the_close_and_connections_dropped_mid_stream() -> None:
    bare = _BareServer()
    try:
        server = Server(f"http://127.0.0.1:{bare.port}", "m", "url")
        req = completion_request([1], 2)
        close, drop = (type(req)(req.endpoint, {**req.payload, "mode": m}) for m in ("close", "drop"))
        records, _ = run_load(server, [close, drop, close], 1)
        assert (records[0].error, records[0].text, records[0].output_tokens) == (None, "ab", 2)
        # the dropped stream keeps what came and says why it ended; the worker then reconnects
        assert records[1].text == "a" and records[1].error is not None and records[1].output_tokens == 0
        assert (records[2].error, records[2].text) == (None, "ab")
    finally:
        bare.close()


def test_a_request_on_a_connection_the_server_dropped_is_sent_again() -> None:
    bare = _BareServer()
    try:
        server = Server(f"http://127.0.0.1:{bare.port}", "m", "url")
        req = completion_request([1], 1)
        keep = type(req)(req.endpoint, {**req.payload, "mode": "keep"})
        records, _ = run_load(server, [keep, keep, keep], 1)
        assert [(r.error, r.text) for r in records] == [(None, "k")] * 3
        assert bare.accepted == 3  # each later request met a dropped connection and went on a new one
    finally:
        bare.close()


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="plain http"):
        run_load(Server("https://127.0.0.1:1", "m", "url"), [completion_request([1], 1)], 1)
