"""A real ``kvserve serve --kv-disk-dir`` process: after a SIGTERM and a new start on the same
folder, a prompt seen before is a prefix-cache hit (restored from the disk tier)."""
from __future__ import annotations

import signal

import httpx

from tests.server.conftest import SERVER_START_TIMEOUT_S, start_server_process, stop_server_process, wait_healthy

PROMPT = ("The disk tier keeps the KV of prompts it has seen across restarts of the server, so this "
          "sentence, repeated a few times, should come back as cached tokens after the restart. ") * 4


def ask(base_url: str) -> dict:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        r.raise_for_status()
        return r.json()


def test_restarted_server_reports_cached_tokens_from_the_disk_tier(tmp_path):
    folder = tmp_path / "kv"
    args = ("--kv-disk-dir", str(folder), "--kv-disk-gib", "0.5")
    first = start_server_process(tmp_path, *args)
    try:
        wait_healthy(first.base_url, SERVER_START_TIMEOUT_S, first.proc)
        before = ask(first.base_url)
        assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        first.proc.send_signal(signal.SIGTERM)  # the drain writes the pool's cached blocks to disk
        assert first.proc.wait(60) == 0, first.log()
    finally:
        stop_server_process(first)
    assert list(folder.glob("*.kvb"))
    second = start_server_process(tmp_path, *args)
    try:
        wait_healthy(second.base_url, SERVER_START_TIMEOUT_S, second.proc)
        after = ask(second.base_url)
        prompt_tokens = after["usage"]["prompt_tokens"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16 > 0
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        stop_server_process(second)
