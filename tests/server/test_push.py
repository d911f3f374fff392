"""server/push.py: frames written where the engine's outputs arrive, in order, through uvicorn's
flow control; the response ends its run exactly once, however it ends.

The bytes of real streams (chat, completions, n > 1, usage, errors, disconnects) are held by the
server tests over HTTP (test_sse_frames, test_openai_sdk, test_lifecycle); these pin the writer's
contract with ASGI ``send`` callables that complete at once, wait, or fail.
"""
from __future__ import annotations

import asyncio

import pytest

from server.push import FrameWriter, PushedSSE


class Sink:
    """An ASGI ``send``: records bodies; while ``gate`` is clear a send waits for it, as uvicorn's
    does while its flow control has paused writing."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.bodies: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with = fail_with

    async def __call__(self, message: dict) -> None:
        if not self.gate.is_set():
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        self.bodies.append(message.get("body", b"") if message["type"] == "http.response.body" else b"<start>")


def test_a_send_that_does_not_wait_runs_inside_write():
    async def main():
        send = Sink()
        writer = FrameWriter(send, asyncio.get_running_loop())
        writer.write("a")
        assert send.bodies == [b"a"]  # no task between the write and the socket
        writer.write("b")
        writer.end()
        assert send.bodies == [b"a", b"b", b""] and writer.done.done() and writer.done.result() is None
        writer.write("late")
        assert send.bodies == [b"a", b"b", b""]

    asyncio.run(main())


def test_frames_written_while_a_send_waits_go_out_after_it_in_order():
    async def main():
        send = Sink()
        writer = FrameWriter(send, asyncio.get_running_loop())
        writer.write("1")
        send.gate.clear()  # the client stops reading
        writer.write("2")
        writer.write("3")
        writer.end()
        writer.write("after the end")
        await asyncio.sleep(0.01)
        assert send.bodies == [b"1"] and not writer.done.done() and writer.ended
        send.gate.set()
        await asyncio.wait_for(writer.done, 5)
        assert send.bodies == [b"1", b"2", b"3", b""]

    asyncio.run(main())


def test_a_send_that_fails_fails_the_writer_and_nothing_more_is_sent():
    async def main():
        send = Sink(fail_with=RuntimeError("socket gone"))
        writer = FrameWriter(send, asyncio.get_running_loop())
        writer.write("a")
        with pytest.raises(RuntimeError, match="socket gone"):
            writer.done.result()
        send.fail_with = None
        writer.write("b")
        assert send.bodies == []

    asyncio.run(main())


def test_abandon_stops_a_waiting_send_and_drops_the_queue():
    async def main():
        send = Sink()
        send.gate.clear()
        writer = FrameWriter(send, asyncio.get_running_loop())
        writer.write("1")
        writer.write("2")
        writer.abandon()
        send.gate.set()
        await asyncio.sleep(0.01)
        assert send.bodies == [] and writer.done.cancelled()

    asyncio.run(main())


def _receive_until(disconnect: asyncio.Event):
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


def test_the_response_closes_its_run_once_when_the_run_ends():
    async def main():
        send, closed = Sink(), []

        def open_run(writer):
            writer.write("data: 1\n\n")
            asyncio.get_running_loop().call_soon(writer.end)
            return lambda: closed.append("closed")

        await PushedSSE(open_run)({"type": "http"}, _receive_until(asyncio.Event()), send)
        assert send.bodies == [b"<start>", b"data: 1\n\n", b""] and closed == ["closed"]

    asyncio.run(main())


def test_the_response_closes_its_run_once_when_the_client_leaves():
    async def main():
        send, closed, gone = Sink(), [], asyncio.Event()

        def open_run(writer):
            writer.write("data: 1\n\n")
            asyncio.get_running_loop().call_soon(gone.set)  # the client leaves; the run never ends
            return lambda: closed.append("closed")

        await asyncio.wait_for(PushedSSE(open_run)({"type": "http"}, _receive_until(gone), send), 5)
        assert send.bodies == [b"<start>", b"data: 1\n\n"] and closed == ["closed"]

    asyncio.run(main())


def test_a_run_that_fails_is_closed_and_its_error_raised_but_a_closed_socket_is_a_client_that_left():
    async def main():
        for error, raised in ((ValueError("a formatting bug"), True), (ConnectionResetError("reset"), False)):
            send, closed = Sink(), []

            def open_run(writer, error=error):
                asyncio.get_running_loop().call_soon(writer.fail, error)
                return lambda: closed.append("closed")

            response = PushedSSE(open_run)({"type": "http"}, _receive_until(asyncio.Event()), send)
            if raised:
                with pytest.raises(ValueError, match="formatting bug"):
                    await response
            else:
                await response
            assert closed == ["closed"]

    asyncio.run(main())


def test_the_response_has_no_content_length_and_keeps_extra_headers():
    headers = dict(PushedSSE(lambda writer: lambda: None, {"x-kvserve-dropped-tools": "web_search"}).raw_headers)
    assert b"content-length" not in headers and headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"x-kvserve-dropped-tools"] == b"web_search" and headers[b"cache-control"] == b"no-cache"


class _PushEngine:
    """An ``EngineClient`` stand-in for the push run: it keeps each request's sink, for the test
    to feed, and records how each was closed (finished or aborted)."""

    model_name = "m"
    tokenizer = None
    info = None

    def __init__(self) -> None:
        self.sinks: dict[str, object] = {}
        self.closed: dict[str, bool] = {}

    def push(self, prompt_ids, params, sink, request_id=None, cache_salt=None, priority=0, tenant=None):
        self.sinks[request_id] = sink
        return lambda finished: self.closed.__setitem__(request_id, finished)


def test_an_engine_error_in_one_choice_ends_the_stream_and_aborts_the_others():
    """n = 2: choice 0 fails mid-stream; its error frame and [DONE] end the stream, and choice 1's
    later outputs make no frames and no closing. Closing the run closes each request as finished
    (its last output came), so nothing is aborted twice."""
    from kvtypes.outputs import RequestOutput
    from kvtypes.sampling_params import SamplingParams
    from server.config import ServerConfig
    from server.protocol import CompletionRequest
    from server.serving import OpenAIServing
    from server.stream_frames import CompletionFrames

    class Frames(CompletionFrames):  # records what the run asked of it
        made: list[str] = []

        def output(self, choice, out):
            self.made.append(out.text)
            return super().output(choice, out)

        def closing(self):
            self.made.append("closing")
            return super().closing()

    async def main():
        engine = _PushEngine()
        serving = OpenAIServing(engine, ServerConfig())
        jobs = serving._jobs("cmpl-x", [[5, 6, 7]], SamplingParams(max_tokens=8), 2)
        body = CompletionRequest(model="m", prompt=[5, 6, 7], stream=True, n=2, max_tokens=8)
        send = Sink()
        writer = FrameWriter(send, asyncio.get_running_loop())
        close = serving._push_run(jobs, None, Frames("cmpl-x", "m", jobs, body, serving.logprobs), writer)
        first, second = (engine.sinks[j.request_id] for j in jobs)
        first(RequestOutput(jobs[0].request_id, [11], "a", num_output_tokens=1))
        second(RequestOutput(jobs[1].request_id, [12], "b", num_output_tokens=1))
        first(RequestOutput(jobs[0].request_id, [], "", True, "error", error="the step failed"))
        second(RequestOutput(jobs[1].request_id, [13], "c", num_output_tokens=2))
        second(RequestOutput(jobs[1].request_id, [14], "d", True, "length", num_output_tokens=3))
        close()
        return send.bodies, writer, engine.closed, jobs

    bodies, writer, closed, jobs = asyncio.run(main())
    texts = [b.decode() for b in bodies]
    assert [t.split('"text": ')[1].split(",")[0] for t in texts[:2]] == ['"a"', '"b"']
    assert '"error"' in texts[2] and "the step failed" in texts[2] and texts[3:] == ["data: [DONE]\n\n", ""]
    assert writer.ended and writer.done.result() is None
    assert Frames.made == ["a", "b"]  # nothing made after the error: no closing (Responses would store)
    assert closed == {jobs[0].request_id: True, jobs[1].request_id: True}


def test_the_body_goes_to_the_servers_send_and_the_headers_through_every_middleware():
    """In kvserve's app, a pushed response's start passes the middleware (the access log adds
    X-Request-Id, a wrapping layer sees it) and its frames go to the server's own ``send``."""
    from server.app import KVServeApp

    seen_by_middleware: list[str] = []

    class Watching:  # a pure ASGI middleware that wraps send, as Starlette's error layers do
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def watched(message):
                seen_by_middleware.append(message["type"])
                await send(message)
            await self.app(scope, receive, watched)

    app = KVServeApp()
    app.add_middleware(Watching)

    def open_run(writer):
        writer.write("data: 1\n\n")
        writer.write("data: 2\n\n")
        asyncio.get_running_loop().call_soon(writer.end)
        return lambda: None

    app.add_api_route("/stream", lambda: PushedSSE(open_run))
    sent: list[dict] = []

    async def server_send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/stream", "raw_path": b"/stream", "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": ""}
    asyncio.run(app(scope, _receive_until(asyncio.Event()), server_send))
    assert [m.get("body") for m in sent] == [None, b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[0]["status"] == 200 and b"x-request-id" in dict(sent[0]["headers"])
    assert seen_by_middleware == ["http.response.start"]
