"""The suite's HTTP client: streamed requests at a fixed concurrency, their summary, ``/metrics``.

``run_load`` sends requests through ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage`` at a fixed concurrency (closed loop:
a new request starts when one finishes) and records per request the time to the first
content chunk (TTFT), the time to the last one, the token counts from the final usage chunk
and ``cached_tokens``. TPOT = (last - first) / (completion tokens - 1), as vLLM's
benchmark_serving computes it. ``scrape_metrics`` reads ``/metrics`` for counter deltas.
The same client drives kvserve and the peer servers (``bench.peers.base.Server``).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Sequence

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
                                 headers=headers(server.api_key), limits=limits) as client:
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
