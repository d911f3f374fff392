"""The suite's HTTP client: streamed requests at a fixed concurrency, their summary, ``/metrics``.

``run_load`` sends requests through ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage`` at a fixed concurrency (closed loop:
a new request starts when one finishes) and records per request the time to the first
content chunk (TTFT), the time to the last one, the token counts from the final usage chunk
and ``cached_tokens``. TPOT = (last - first) / (completion tokens - 1), as vLLM's
benchmark_serving computes it. ``scrape_metrics`` reads ``/metrics`` for counter deltas.
The same client drives kvserve and the peer servers (``bench.peers.base.Server``).

The streams are read by a small HTTP/1.1 client on asyncio protocols (uvloop's loop where it is
installed; one keep-alive connection per worker; chunked, Content-Length or read-to-close bodies),
not httpx: on this project's 2-core machines the client shares the cores with the server it
measures, and httpx's streaming cost 0.14-0.45 ms of CPU a token (1-16 streams), time taken from
both servers alike but a larger share of the faster one's shorter steps (docs/benchmarks.md, "a
nineteenth session"). This client takes 0.04-0.18 ms.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence
from urllib.parse import urlsplit

import httpx

from bench.peers.base import Server, headers
from bench.report import percentiles


@dataclass
class StreamRequest:
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    payload: dict[str, Any]  # without model / stream fields


def completion_request(prompt_token_ids: Sequence[int], max_tokens: int, ignore_eos: bool = True,
                       **extra: Any) -> StreamRequest:
    """Greedy completion of exact token ids; ``ignore_eos`` (a vLLM/kvserve extension) makes the
    output exactly ``max_tokens`` long."""
    payload = {"prompt": [int(t) for t in prompt_token_ids], "max_tokens": max_tokens, "temperature": 0.0,
               **({"ignore_eos": True} if ignore_eos else {}), **extra}
    return StreamRequest("/v1/completions", payload)


def chat_request(messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> StreamRequest:
    return StreamRequest("/v1/chat/completions",
                         {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra})


@dataclass
class Record:
    send_s: float = 0.0  # from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    last_s: float | None = None  # time of the last content chunk, from send
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str | None = None
    chunks: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.last_s is None or self.output_tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.output_tokens - 1)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: the bytes received so far, and a wake-up when more come."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def receive(self) -> None:
        """Wait until more bytes arrive; ConnectionError once the server has closed."""
        if self.closed:
            raise ConnectionError("the server closed the connection")
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def take_until(self, marker: bytes) -> bytes:
        """The bytes before the next ``marker`` (consumed with it)."""
        while (i := self.buffer.find(marker)) < 0:
            await self.receive()
        out = bytes(self.buffer[:i])
        del self.buffer[:i + len(marker)]
        return out

    async def take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self.receive()
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class _Target:
    host: str
    port: int
    model: str
    headers: dict[str, str]


async def _body_parts(conn: _Connection, head: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, Content-Length or until the server closes."""
    if "chunked" in head.get("transfer-encoding", ""):
        while True:
            size = int((await conn.take_until(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await conn.take_until(b"\r\n")  # no trailers from these servers
                return
            yield await conn.take(size)
            await conn.take(2)
    elif "content-length" in head:
        yield await conn.take(int(head["content-length"]))
    else:
        while not conn.closed:
            if conn.buffer:
                yield bytes(conn.buffer)
                conn.buffer.clear()
            try:
                await conn.receive()
            except ConnectionError:
                break
        if conn.buffer:
            yield bytes(conn.buffer)
            conn.buffer.clear()


def _take_chunk(rec: Record, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        rec.error = str(chunk["error"].get("message", chunk["error"]))
        return
    for choice in chunk.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content") or ""
        if text:
            rec.chunks += 1
            rec.text += text
            if rec.ttft_s is None:
                rec.ttft_s = now
            rec.last_s = now
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = usage.get("completion_tokens", 0)
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def _one(slot: list[_Connection | None], target: _Target, req: StreamRequest, start: float) -> Record:
    """One streamed request on the worker's connection (``slot``; opened or reopened as needed)."""
    rec = Record()
    body = json.dumps({**req.payload, "model": target.model, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = (f"POST {req.endpoint} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
               f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n"
               + "".join(f"{k}: {v}\r\n" for k, v in target.headers.items()) + "\r\n").encode() + body
    sent = time.perf_counter()
    rec.send_s = sent - start
    conn = slot[0]
    try:
        for fresh in ((False, True) if conn is not None and not conn.closed else (True,)):
            if fresh:
                _, conn = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                    _Connection, target.host, target.port), timeout=30)
                slot[0] = conn
            assert conn is not None and conn.transport is not None
            conn.transport.write(request)
            try:
                lines = (await conn.take_until(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                break
            except ConnectionError:
                # a kept-alive connection the server has since closed (llama-server's cpp-httplib
                # ends one after 5 requests or 5 idle seconds): sent again on a new one, as httpx does
                if fresh:
                    raise
                conn.close()
        status = int(lines[0].split(" ", 2)[1])
        head = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if status != 200:
            rec.error = f"HTTP {status}: {b''.join([p async for p in _body_parts(conn, head)])[:200]!r}"
        else:
            pending, done = bytearray(), False
            async for part in _body_parts(conn, head):
                pending += part
                while (i := pending.find(b"\n")) >= 0:
                    line = bytes(pending[:i]).rstrip(b"\r")
                    del pending[:i + 1]
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        _take_chunk(rec, json.loads(line[6:]), time.perf_counter() - sent)
            if not done and rec.error is None:  # e.g. a body read to the close, cut short
                rec.error = "the stream ended before data: [DONE]"
        if head.get("connection", "").lower() == "close" or not (
                "chunked" in head.get("transfer-encoding", "") or "content-length" in head):
            conn.close()
            slot[0] = None
    except (OSError, asyncio.TimeoutError, ValueError, IndexError) as exc:  # ValueError: bad JSON or framing
        rec.error = f"{type(exc).__name__}: {exc}"
        if conn is not None:
            conn.close()
        slot[0] = None
    rec.e2e_s = time.perf_counter() - sent
    return rec


async def _run_load(server: Server, requests: Sequence[StreamRequest], concurrency: int,
                    progress: Any = None) -> tuple[list[Record], float]:
    url = urlsplit(server.url)
    if url.scheme != "http" or url.hostname is None:
        raise ValueError(f"the bench client speaks plain http://host:port, not {server.url!r}")
    target = _Target(url.hostname, url.port or 80, server.model, headers(server.api_key))
    records: list[Record | None] = [None] * len(requests)
    next_index = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        slot: list[_Connection | None] = [None]
        try:
            while next_index < len(requests):
                i = next_index
                next_index += 1
                records[i] = await _one(slot, target, requests[i], start)
                if progress is not None:
                    progress.update(1)
        finally:
            if slot[0] is not None:
                slot[0].close()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(requests))))))
    elapsed = time.perf_counter() - start
    return [r for r in records if r is not None], elapsed


def run_load(server: Server, requests: Sequence[StreamRequest], concurrency: int,
             progress: Any = None) -> tuple[list[Record], float]:
    """Send ``requests`` at ``concurrency`` (closed loop); return the records and the wall time."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_run_load(server, requests, concurrency, progress))


def _loop_factory() -> Any:
    try:
        import uvloop  # kvserve's own dependency (uvicorn's loop): ~2x less CPU a chunk than asyncio's
    except ImportError:  # pragma: no cover - a platform without uvloop
        return None
    return uvloop.new_event_loop


def summarize(records: Sequence[Record], elapsed_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles (ms) of one load run."""
    ok = [r for r in records if not r.error]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = percentiles([1000 * r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = percentiles([1000 * r.tpot_s for r in ok if r.tpot_s is not None])
    e2e = percentiles([1000 * r.e2e_s for r in ok if r.e2e_s is not None], (50, 99))
    tpots = [r.tpot_s for r in ok if r.tpot_s]
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "first_error": next((r.error for r in records if r.error), None),
        "elapsed_s": round(elapsed_s, 3),
        "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "output_tps": round(out_tokens / elapsed_s, 3) if elapsed_s > 0 else None,
        "req_per_s": round(len(ok) / elapsed_s, 4) if elapsed_s > 0 else None,
        # decode tokens/s of one stream: 1 / mean TPOT
        "stream_decode_tps": round(len(tpots) / sum(tpots), 3) if tpots else None,
        **{f"ttft_{k}_ms": _round(v) for k, v in ttft.items()},
        **{f"tpot_{k}_ms": _round(v) for k, v in tpot.items()},
        **{f"e2e_{k}_ms": _round(v) for k, v in e2e.items()},
    }


def _round(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)


def scrape_metrics(server: Server) -> dict[str, float] | None:
    """Every sample of ``/metrics``, summed over labels, by sample name; None if unavailable."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(f"{server.url}/metrics", headers=headers(server.api_key), timeout=30)
        if r.status_code != 200:
            return None
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
        return values
    except Exception:  # noqa: BLE001 - a peer server without /metrics: the rate is just unknown
        return None


def metric_delta(before: dict[str, float] | None, after: dict[str, float] | None, name: str) -> float | None:
    if before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def prefix_hit_rate(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Prefix-cache hit rate (tokens) between two scrapes: hits_total / queries_total deltas."""
    hits = metric_delta(before, after, "kvserve_prefix_cache_hits_total")
    queries = metric_delta(before, after, "kvserve_prefix_cache_queries_total")
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "prefix_hit_rate": round(hits / queries, 4) if hits is not None and queries else None,
            "preemptions": metric_delta(before, after, "kvserve_num_preemptions_total")}
