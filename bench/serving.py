"""The serving side of the suite: a kvserve server to talk to, and an async streaming client.

Three ways to get a server (``Server``, all closed with ``.close()``):

* ``start_subprocess``: ``python -m kvserve.cli serve --port P ...`` (what ``kvserve serve``
  runs), its log in a file, ready when ``/health`` answers 200; closed with SIGTERM;
* ``start_inprocess``: an app someone composed (``kvserve.compose.build_service``; bench never
  imports server/) under uvicorn in a thread (tests use it with a tiny engine);
* ``connect``: a server someone else runs (``--url``).

``run_load`` sends requests through ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage`` at a fixed concurrency (closed loop:
a new request starts when one finishes) and records per request the time to the first
content chunk (TTFT), the time to the last one, the token counts from the final usage chunk
and ``cached_tokens``. TPOT = (last - first) / (completion tokens - 1), as vLLM's
benchmark_serving computes it. ``scrape_metrics`` reads ``/metrics`` for counter deltas.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

from bench.report import percentiles

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str
    kind: str  # "subprocess" | "inprocess" | "url"
    api_key: str | None = None
    log_path: str | None = None
    _close: Any = None
    pid: int | None = None  # the server process when it is our child (its CPU is not "foreign" load)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _model_name(url: str, api_key: str | None) -> str:
    r = httpx.get(f"{url}/v1/models", headers=_headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def wait_healthy(url: str, timeout_s: float, alive: Any = lambda: True) -> None:
    """Poll ``url``/health until it answers 200; fail early once ``alive()`` is False."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it became healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def connect(url: str, api_key: str | None = None) -> Server:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    wait_healthy(url, 30)
    return Server(url, _model_name(url, api_key), "url", api_key)


def launch(cmd: Sequence[str], url: str, kind: str, log_path: str | os.PathLike | None = None,
           timeout_s: float = 300.0, model: str | None = None, **popen: Any) -> Server:
    """Start ``cmd``, a server that will answer at ``url``; a ``Server`` once ``/health`` is 200.

    Output goes to ``log_path`` (appended) or nowhere. ``close()`` sends SIGTERM and kills after
    30 s; a child that exits or stays unhealthy for ``timeout_s`` is closed and the error raised.
    ``model`` defaults to the first id that ``/v1/models`` lists.
    """
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, **popen)

    def close() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if log is not subprocess.DEVNULL:
            log.close()

    try:
        wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
        model = model or _model_name(url, None)
    except BaseException:
        close()
        raise
    return Server(url, model, kind, None, str(log_path) if log_path else None, close, proc.pid)


def start_subprocess(serve_args: Sequence[str] = (), port: int | None = None, log_path: str | os.PathLike | None = None,
                     timeout_s: float = 300.0) -> Server:
    """``kvserve serve --host 127.0.0.1 --port P *serve_args`` in a child process."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--shutdown-grace", "2", *serve_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("KVSERVE_API_KEY", None)
    return launch(cmd, f"http://127.0.0.1:{port}", "subprocess", log_path, timeout_s, cwd=REPO_ROOT, env=env)


def start_inprocess(app: Any, model_name: str, port: int | None = None) -> Server:
    """``app`` (an ASGI app, e.g. ``kvserve.compose.build_service(...).app``) under uvicorn in a daemon
    thread; the app's lifespan stops its engine when the server is closed."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def close() -> None:
        server.should_exit = True
        thread.join(30)

    try:
        wait_healthy(url, 60, alive=thread.is_alive)
    except BaseException:
        close()
        raise
    return Server(url, model_name, "inprocess", None, None, close)


# ---- the client ----------------------------------------------------------------------------------
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


async def _one(client: httpx.AsyncClient, model: str, req: StreamRequest, start: float) -> Record:
    rec = Record()
    body = {**req.payload, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    rec.send_s = sent - start
    try:
        async with client.stream("POST", req.endpoint, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                now = time.perf_counter() - sent
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
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e_s = time.perf_counter() - sent
    return rec


async def _run_load(server: Server, requests: Sequence[StreamRequest], concurrency: int,
                    progress: Any = None) -> tuple[list[Record], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(None, connect=30),
                                 headers=_headers(server.api_key), limits=limits) as client:
        records: list[Record | None] = [None] * len(requests)
        next_index = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(requests):
                i = next_index
                next_index += 1
                records[i] = await _one(client, server.model, requests[i], start)
                if progress is not None:
                    progress.update(1)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(requests))))))
        elapsed = time.perf_counter() - start
    return [r for r in records if r is not None], elapsed


def run_load(server: Server, requests: Sequence[StreamRequest], concurrency: int,
             progress: Any = None) -> tuple[list[Record], float]:
    """Send ``requests`` at ``concurrency`` (closed loop); return the records and the wall time."""
    return asyncio.run(_run_load(server, requests, concurrency, progress))


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


# ---- /metrics ------------------------------------------------------------------------------------
def scrape_metrics(server: Server) -> dict[str, float] | None:
    """Every sample of ``/metrics``, summed over labels, by sample name; None if unavailable."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(f"{server.url}/metrics", headers=_headers(server.api_key), timeout=30)
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


class LoadMonitor:
    """CPU used by *other* processes while a block ran, in cores: the whole machine's busy time
    minus this process, its finished children (node) and ``pids`` (the server subprocess with its
    live descendants: the engine core process and any tensor-parallel ranks).
    ``bench.common.CpuMonitor`` counts a server subprocess as foreign; this one does not."""

    def __init__(self, pids: Sequence[int | None] = ()) -> None:
        self.pids = [p for p in pids if p]
        self.foreign_cores: float | None = None

    def _ours(self) -> float:
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        from bench.common import tree_cpu_seconds

        # With the engine core in its own process (and its tensor-parallel ranks) the server is a tree.
        return total + sum(tree_cpu_seconds(pid) for pid in self.pids)

    def __enter__(self) -> "LoadMonitor":
        from bench.common import _system_busy_s

        self._busy0, self._ours0, self._t0 = _system_busy_s(), self._ours(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        from bench.common import _system_busy_s

        busy, ours, wall = _system_busy_s(), self._ours(), time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.foreign_cores = round(max(0.0, (busy - self._busy0) - (ours - self._ours0)) / wall, 2)


@dataclass
class Progress:
    """A tqdm bar (to stderr) when tqdm is installed and enabled; a no-op otherwise."""

    total: int
    desc: str
    enabled: bool = True
    _bar: Any = field(default=None, init=False)

    def __enter__(self) -> "Progress":
        if self.enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=self.total, desc=self.desc, unit="req", leave=False, file=sys.stderr)
            except ImportError:
                self._bar = None
        return self

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
