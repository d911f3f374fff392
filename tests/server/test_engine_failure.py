"""An engine that dies mid-stream: the stream gets an error frame and [DONE], health turns 503,
new requests fail fast with 500 instead of hanging. Runs on a tiny random model (token-id prompts)."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers import tiny_engine, tiny_hf_model
from tests.server.conftest import SERVER_START_TIMEOUT_S, free_port, parse_sse, wait_healthy


@pytest.fixture
def dying_server():
    import uvicorn

    from engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.config import ServerConfig

    engine = tiny_engine(tiny_hf_model())
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, ServerConfig(log_stats_interval_s=0))
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def execute(plan):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("simulated kernel fault")
        return real_execute(plan)

    engine.runner.execute = execute
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, SERVER_START_TIMEOUT_S)
    yield base
    server.should_exit = True
    thread.join(30)


def test_engine_failure_mid_stream(dying_server):
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        raw = http.post(f"{dying_server}/v1/completions", json=body).text
        assert raw.endswith("data: [DONE]\n\n")
        events = parse_sse(raw)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "simulated kernel fault" in errors[0]["error"]["message"]
        assert errors[0]["error"]["type"] == "internal_server_error"
        # The tiny model has no tokenizer, so no text chunks; but nothing may claim a normal finish.
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))

        health = http.get(f"{dying_server}/health")
        assert health.status_code == 503 and "simulated kernel fault" in health.json()["error"]
        again = http.post(f"{dying_server}/v1/completions", json={**body, "stream": False})
        assert again.status_code == 500 and again.json()["error"]["code"] == "engine_dead"


def test_max_completion_tokens_wins_over_max_tokens(client, live_server):
    reply = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Count to twenty."}],
        max_tokens=3, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
