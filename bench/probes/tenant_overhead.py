"""What a key file of many tenants costs: the same streamed greedy work against ``kvserve serve``
without a key file and with one of ``--tenants`` tenants, side by side in one run.

    python -m bench.probes.tenant_overhead [--tenants 1000] [--streams 16] [--tokens 128] [--rounds 3]
                                           [kvserve serve flags]

Starts both servers (same flags; the second with ``--api-key-file`` of ``--tenants`` tenants,
each with a key, a concurrency limit and a tokens-per-minute budget far above what the run uses,
so every request pays the lookup, the salt, the admission and the accounting, and none is
refused). Each round sends ``--streams`` concurrent streamed chat completions (distinct prompts;
with the key file, stream i uses tenant i's key) to one server, then the other, alternating
which goes first; it prints each round's output tok/s, the medians, and the key-file server's
ratio to the other. The issue's line is >= 0.98x at 1,000 tenants and 16 streams. Measure on an
otherwise idle machine: the two servers share its cores with whatever else runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import httpx

from bench.server import REPO_ROOT, free_port, launch, start_subprocess


def write_key_file(path: Path, tenants: int) -> list[str]:
    """A key file of ``tenants`` tenants (plain keys); returns the keys in tenant order."""
    keys = [f"sk-bench-tenant-{i:05d}" for i in range(tenants)]
    lines = ["tenants:"]
    for i, key in enumerate(keys):
        lines += [f"  - name: tenant-{i:05d}", f"    keys: [{key}]", "    max_concurrent_requests: 64",
                  "    tokens_per_minute: 100000000"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return keys


def _start_with_keys(serve_args: list[str], key_file: Path, model: str):  # noqa: ANN202 - a bench Server
    """``start_subprocess`` with a key file: its model is named up front, since ``/v1/models``
    needs a key there."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--shutdown-grace", "2", *serve_args, "--api-key-file", str(key_file)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("KVSERVE_API_KEY", None)
    return launch(cmd, f"http://127.0.0.1:{port}", "subprocess", None, 300.0, model=model, cwd=REPO_ROOT, env=env)


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, tokens: int, key: str | None) -> int:
    # Without a key file each stream gets a cache_salt of its own: with the key file each stream is
    # its own tenant, whose prefixes nobody else shares, so both sides prefill the same tokens
    # (sharing the chat template's prefix across streams would otherwise favour the side without).
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            **({} if key else {"cache_salt": f"stream-{zlib.crc32(prompt.encode()):08x}"}),
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    count = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                count = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens") or count
    return count


async def _round(url: str, model: str, prompts: list[str], tokens: int, keys: list[str | None]) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, model, p, tokens, k) for p, k in zip(prompts, keys)))
        return sum(counts), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.tenant_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args, serve_args = parser.parse_known_args(argv)
    prompts = [f"Story {i}: tell me a long story about a lighthouse keeper and the sea." for i in range(args.streams)]
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "keys.yaml"
        keys = write_key_file(key_file, args.tenants)
        stream_keys = [keys[i * max(1, args.tenants // args.streams) % args.tenants] for i in range(args.streams)]
        plain = start_subprocess(serve_args)
        try:
            tenants = _start_with_keys(serve_args, key_file, plain.model)
        except BaseException:
            plain.close()
            raise
        sides = {"no key file": (plain, [None] * args.streams),
                 f"{args.tenants} tenants": (tenants, stream_keys)}
        try:
            for server, ks in sides.values():  # warm-up: prefixes cached once, every path compiled
                asyncio.run(_round(server.url, server.model, prompts[:2], 8, ks[:2]))
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    server, ks = sides[name]
                    tokens, wall = asyncio.run(_round(server.url, server.model, prompts, args.tokens, ks))
                    rates[name].append(tokens / wall)
                    print(f"round {r + 1} {name:14s} {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tok/s")
            base = statistics.median(rates["no key file"])
            for name in sides:
                median = statistics.median(rates[name])
                print(f"{name:14s} median {median:.1f} tok/s  ({median / base:.3f}x no key file)")
            # each round's two runs are adjacent in time, so their ratio sees the same machine
            paired = [t / p for t, p in zip(rates[f"{args.tenants} tenants"], rates["no key file"])]
            print(f"median of the rounds' ratios: {statistics.median(paired):.3f}x "
                  f"(rounds: {', '.join(f'{r:.3f}' for r in paired)})")
        finally:
            tenants.close()
            plain.close()


if __name__ == "__main__":
    main()
