"""A real kvserve HTTP server for the server tests, plus OpenAI schema validation and SSE helpers.

The server is what ``kvserve serve`` builds (``kvserve.compose.build_service``, the served
default: the engine core in its own process) under uvicorn in a background thread on a free
port of 127.0.0.1, with an API key so every request exercises auth. Tests see the engine only
through its client (its ``StepStats`` snapshots), as the server does.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from bench.server import wait_healthy as poll_health

API_KEY = "sk-kvserve-test-key"
REPO = Path(__file__).resolve().parents[2]
# How long a server may take to load the model and answer /health. Generous: on a busy
# two-core machine a subprocess server's start can take minutes; nothing is measured by it.
SERVER_START_TIMEOUT_S = 300


# ---- OpenAI's published schemas --------------------------------------------------------------
# The part of OpenAI's openapi.yaml the tests use, vendored (tests/assets/openai_spec/extract_schemas.py
# cuts it out of the spec and records the commit); nothing outside the repository is read.
OPENAI_SCHEMAS = REPO / "tests" / "assets" / "openai_spec" / "schemas.json"


def nullable_to_json_schema(node: Any) -> Any:
    """OpenAPI 3.0 ``nullable: true`` -> a JSON-Schema union with null (enums included)."""
    if isinstance(node, list):
        return [nullable_to_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: nullable_to_json_schema(v) for k, v in node.items()}
    nullable = out.get("nullable")
    if isinstance(nullable, bool):  # a bool, not a property that happens to be called "nullable"
        del out["nullable"]
        if nullable:
            return {"anyOf": [out, {"type": "null"}]}
    return out


class OpenAISchemas:
    """``validate("CreateChatCompletionResponse", body)`` against ``#/components/schemas/...``."""

    URI = "urn:openai-openapi"

    def __init__(self, spec_path: Path) -> None:
        from jsonschema import Draft202012Validator
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        doc = json.loads(spec_path.read_text(encoding="utf-8"))
        doc = {"components": nullable_to_json_schema(doc["components"])}
        self.schemas = doc["components"]["schemas"]
        self._registry = Registry().with_resource(self.URI, Resource(contents=doc, specification=DRAFT202012))
        self._validator_cls = Draft202012Validator
        self._validators: dict[str, Any] = {}

    def validator(self, name: str):
        if name not in self._validators:
            assert name in self.schemas, f"no schema {name!r} in the OpenAPI spec"
            self._validators[name] = self._validator_cls(
                {"$ref": f"{self.URI}#/components/schemas/{name}"}, registry=self._registry)
        return self._validators[name]

    def errors(self, name: str, instance: Any) -> list[str]:
        return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in self.validator(name).iter_errors(instance)]

    def validate(self, name: str, instance: Any) -> None:
        errors = self.errors(name, instance)
        assert not errors, f"{name} schema violations:\n" + "\n".join(errors[:10]) + f"\n{json.dumps(instance)[:2000]}"


@pytest.fixture(scope="session")
def openai_schemas() -> OpenAISchemas:
    return OpenAISchemas(OPENAI_SCHEMAS)


# ---- SSE ----------------------------------------------------------------------------------
def parse_sse(raw: str) -> list[Any]:
    """Strictly framed SSE: only ``data: <json>\\n\\n`` frames, the last one ``data: [DONE]\\n\\n``.

    Returns the decoded JSON payloads (without the [DONE] sentinel).
    """
    assert raw.endswith("data: [DONE]\n\n"), f"stream does not end with [DONE]: {raw[-200:]!r}"
    frames = raw.split("\n\n")
    assert frames[-1] == "", repr(raw[-200:])
    frames = frames[:-1]
    assert frames[-1] == "data: [DONE]"
    assert frames.count("data: [DONE]") == 1
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: "), f"bad SSE frame {frame!r}"
        body = frame[len("data: "):]
        assert "\n" not in body, f"multi-line SSE frame {frame!r}"
        payloads.append(json.loads(body))
    return payloads


# ---- the in-process server ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """bench.server's health poll, failing early when ``proc`` has exited."""
    poll_health(base_url, timeout, alive=(lambda: proc.poll() is None) if proc is not None else (lambda: True))


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    engine: Any  # the engine client (engine.core.process_client.MPEngineClient)
    app: Any

    @property
    def async_engine(self) -> Any:
        return self.engine

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the core's latest snapshot shows no request and no KV block held (polled)."""
        deadline = time.monotonic() + timeout
        while True:
            if is_idle(self.engine.stats) and self.engine.num_in_flight == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def is_idle(stats: Any) -> bool:
    """A ``StepStats`` snapshot with nothing running or waiting and no KV block held."""
    return stats is None or (stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_used_blocks == 0)


@pytest.fixture(scope="session")
def live_server():
    import uvicorn

    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from scheduler.config import SchedulerConfig
    from server.config import ServerConfig

    from tests.helpers import EXACT_CACHE_FLAGS, EXACT_MODEL_FLAGS

    # the exact flags (fp32 activations and KV): tests compare its logprobs with transformers
    service = build_service(EngineConfig(model=ModelConfig(num_threads=1, max_model_len=2048, **EXACT_MODEL_FLAGS),
                                         cache=CacheConfig(kv_cache_memory_gib=0.25, **EXACT_CACHE_FLAGS),
                                         scheduler=SchedulerConfig(max_num_seqs=32)),
                            ServerConfig(api_key=API_KEY, max_waiting=256, log_stats_interval_s=0))
    engine, app = service.engine, service.app
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, SERVER_START_TIMEOUT_S)
        yield LiveServer(base_url, API_KEY, engine.model_name, engine, app)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn did not stop"
        assert not engine.is_healthy, "the engine core outlived the app"


@pytest.fixture(scope="session")
def client(live_server):
    import openai

    with openai.OpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def make_async_client(live_server) -> Callable[[], Any]:
    """AsyncOpenAI clients are bound to the event loop they run in: build one per asyncio.run."""
    import openai

    def make():
        return openai.AsyncOpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0, timeout=120)

    return make


@pytest.fixture
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=60) as c:
        yield c


# ---- subprocess servers (signals) -------------------------------------------------------------
@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server_process(tmp_path: Path, *extra: str, env_extra: dict[str, str] | None = None) -> ServerProcess:
    port = free_port()
    log_path = tmp_path / f"kvserve-{port}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("KVSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--max-model-len", "1024",
           "--kv-cache-memory", "0.1", "--num-threads", "1", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def stop_server_process(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)

