"""What a chat-shaped API costs beside chat completions: the same streamed work through
``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages``, side by side in one run.

    python -m bench.probes.api_overhead [--streams 16] [--tokens 128] [--rounds 3] [kvserve serve flags]

Starts ``kvserve serve`` once, then each round sends ``--streams`` concurrent streamed greedy
requests (distinct prompts, the same ones through every endpoint, so the engine work is the same
and the prefix cache helps no endpoint more than another) to each endpoint in turn, and prints
each endpoint's output tok/s (output tokens from the endpoint's own usage over the round's wall
time), their medians over the rounds, and each API's ratio to chat completions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.server import start_subprocess

ENDPOINTS = ("chat", "responses", "messages")


def _body(endpoint: str, model: str, prompt: str, tokens: int) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": tokens, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if endpoint == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "max_output_tokens": tokens, "temperature": 0,
                                 "stream": True, "store": False}
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                            "temperature": 0, "stream": True}


def _output_tokens(endpoint: str, event: dict[str, Any]) -> int | None:
    """The output token count an endpoint's final usage event states, else None."""
    if endpoint == "chat":
        return (event.get("usage") or {}).get("completion_tokens")
    if endpoint == "responses":
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]["usage"]["output_tokens"]
        return None
    return (event.get("usage") or {}).get("output_tokens") if event.get("type") == "message_delta" else None


async def _stream(client: httpx.AsyncClient, endpoint: str, model: str, prompt: str, tokens: int) -> int:
    path, body = _body(endpoint, model, prompt, tokens)
    count = 0
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            found = _output_tokens(endpoint, json.loads(line[6:]))
            count = found if found is not None else count
    return count


async def _round(url: str, endpoint: str, model: str, prompts: list[str], tokens: int) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, endpoint, model, p, tokens) for p in prompts))
        return sum(counts), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.api_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args, serve_args = parser.parse_known_args(argv)
    prompts = [f"Story {i}: tell me a long story about a lighthouse keeper and the sea." for i in range(args.streams)]
    server = start_subprocess(serve_args)
    try:
        for endpoint in ENDPOINTS:  # warm-up: each prompt's prefix cached once, every path compiled
            asyncio.run(_round(server.url, endpoint, server.model, prompts[:2], 8))
        rates: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
        for r in range(args.rounds):
            for endpoint in ENDPOINTS:
                tokens, wall = asyncio.run(_round(server.url, endpoint, server.model, prompts, args.tokens))
                rates[endpoint].append(tokens / wall)
                print(f"round {r + 1} {endpoint:9s} {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tok/s")
        chat = statistics.median(rates["chat"])
        for endpoint in ENDPOINTS:
            median = statistics.median(rates[endpoint])
            print(f"{endpoint:9s} median {median:.1f} tok/s  ({median / chat:.3f}x chat completions)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
