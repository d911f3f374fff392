"""An engine whose steps start failing mid-stream (in-process core, tiny random model, token-id prompts):
the stream gets a generic error frame and [DONE], the detail stays in the log, the engine frees the
blocks and serves on, so /health stays 200 and the next request completes once the fault is gone.
Killed cores and the test-only fault hook of a real server: tests/server/test_core_faults.py."""
from __future__ import annotations

import threading

import httpx
import pytest

from engine.core.protocol import GENERIC_ENGINE_ERROR
from tests.helpers import tiny_engine, tiny_hf_model
from tests.server.conftest import SERVER_START_TIMEOUT_S, free_port, is_idle, parse_sse, wait_healthy


@pytest.fixture
def flaky_server():
    import uvicorn

    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    engine = tiny_engine(tiny_hf_model())
    service = build_service(EngineConfig(), ServerConfig(log_stats_interval_s=0), engine=engine)
    real_execute = engine.runner.execute
    state = {"n": 0, "broken": True}

    def execute(plan):
        state["n"] += 1
        if state["broken"] and state["n"] > 5:
            raise RuntimeError("simulated kernel fault at /internal/path")
        return real_execute(plan)

    engine.runner.execute = execute
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(service.app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, SERVER_START_TIMEOUT_S)
    yield base, state, service.engine
    server.should_exit = True
    thread.join(30)


def test_engine_failure_mid_stream(flaky_server):
    base, state, client = flaky_server
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        raw = http.post(f"{base}/v1/completions", json=body).text
        assert raw.endswith("data: [DONE]\n\n")
        events = parse_sse(raw)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["message"] == GENERIC_ENGINE_ERROR
        assert "simulated" not in raw and "/internal/path" not in raw
        assert errors[0]["error"]["type"] == "internal_server_error"
        # The tiny model has no tokenizer, so no text chunks; but nothing may claim a normal finish.
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
        assert is_idle(client.stats)  # the failed request's blocks are free

        assert http.get(f"{base}/health").status_code == 200  # the engine serves on
        again = http.post(f"{base}/v1/completions", json={**body, "stream": False})
        assert again.status_code == 500 and again.json()["error"]["message"] == GENERIC_ENGINE_ERROR
        state["broken"] = False
        ok = http.post(f"{base}/v1/completions", json={**body, "stream": False, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert is_idle(client.stats)


def test_max_completion_tokens_wins_over_max_tokens(client, live_server):
    reply = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Count to twenty."}],
        max_tokens=3, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
