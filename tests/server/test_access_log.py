"""The access log and ``X-Request-Id`` over real HTTP (server/access_log.py).

The server is what ``kvserve serve`` builds (``kvserve.compose.build_service``) around a tiny
random-weight model with the default model's tokenizer, in thread mode, with a key file of one
tenant, and the root logger's handlers in ``--log-format json`` (``use_log_format``, as
``kvserve serve`` calls it) while this module runs. Every request the tests make goes through
``call``, which remembers it; the last test checks that the log holds exactly one access line for
each of them and nothing else.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import re
import threading
import time

import httpx
import pytest

from tests.helpers import push_through, tiny_engine, tiny_hf_model, tiny_llama_config

KEY = "sk-access-log-secret-1"
SALT = "access-log-salt-secret"
HEX32 = re.compile(r"[0-9a-f]{32}")


class Records(logging.Handler):
    """Every record that reaches the root logger, kept for formatting afterwards."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def access(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == "kvserve.access"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from transformers import AutoTokenizer

    from bench.server import start_inprocess
    from engine.config import EngineConfig
    from engine.loader import resolve_model_dir
    from kvserve.compose import build_service
    from server.access_log import use_log_format
    from server.config import ServerConfig

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    path = tmp_path_factory.mktemp("access") / "keys.yaml"
    path.write_text(f"tenants:\n  - name: alpha\n    keys: [{KEY}]\n    cache_salt: {SALT}\n")
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=1024,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    engine = tiny_engine(tiny_hf_model(config), block_size=16, num_blocks=256, max_num_batched_tokens=1024,
                         tokenizer=tokenizer)
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    saved = [(h, h.formatter, list(h.filters)) for h in old_handlers]
    stream = io.StringIO()
    records, json_out = Records(), logging.StreamHandler(stream)
    for handler in (records, json_out):  # the test's own HTTP client logs its URLs: not the server's lines
        handler.addFilter(lambda rec: not rec.name.startswith(("httpx", "httpcore")))
    root.addHandler(records)
    root.addHandler(json_out)
    root.setLevel(logging.INFO)
    use_log_format("json")
    service = build_service(EngineConfig(), ServerConfig(api_key_file=str(path), log_stats_interval_s=0,
                                                         max_body_bytes=16 * 1024), engine=engine)
    # ``hold`` cleared: each engine stream waits after its first output (until set again), so a
    # client can leave mid-stream, whatever the speed of the tiny model
    hold, generate = threading.Event(), service.engine.generate
    hold.set()

    def held(*args, **kwargs):
        async def run():
            async for out in generate(*args, **kwargs):
                yield out
                while not hold.is_set():
                    await asyncio.sleep(0.01)
        return run()

    service.engine.generate = held
    service.engine.push = push_through(held)
    server = start_inprocess(service.app, service.engine.model_name)
    server.records, server.stream, server.sent, server.hold = records, stream, [], hold
    server.serving = service.app.state.serving
    try:
        yield server
    finally:
        server.close()
        root.removeHandler(records)
        root.removeHandler(json_out)
        for handler, formatter, filters in saved:
            handler.setFormatter(formatter)
            handler.filters[:] = filters
        root.setLevel(old_level)
        logging.captureWarnings(False)


def call(srv, method: str, path: str, json_body: dict | None = None, key: str | None = KEY,
         request_id: str | None = None, headers: dict | None = None, **kwargs) -> httpx.Response:
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    r = httpx.request(method, f"{srv.url}{path}", json=json_body, headers=headers, timeout=120, **kwargs)
    assert "x-request-id" in r.headers, f"{method} {path} {r.status_code}: no X-Request-Id"
    if request_id is not None and re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", request_id):
        assert r.headers["x-request-id"] == request_id  # a valid client id round-trips
    else:
        assert HEX32.fullmatch(r.headers["x-request-id"])  # generated (or an invalid one replaced)
    srv.sent.append(r)
    return r


def access_line(srv, r: httpx.Response) -> dict:
    """The one access line of ``r`` (its fields), waiting for it: the server writes it after the
    last byte went out, which may be just after the client has read it."""
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while True:
        lines = [rec.fields for rec in srv.records.access() if rec.fields["request_id"] == rid]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(lines) == 1, f"{len(lines)} access lines for {rid}"
    return lines[0]


def chat_body(srv, **extra) -> dict:
    return {"model": srv.model, "messages": [{"role": "user", "content": "Say something about the sea."}],
            "max_tokens": 6, **extra}


def stream_payloads(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    frames = [f[len("data: "):] for f in r.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def assert_ran(line: dict, usage: dict, finish_reasons: set[str], response_id: str) -> None:
    assert line["tenant"] == "alpha" and line["status"] == 200
    assert line["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert line["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert line["generated_tokens"] == usage["completion_tokens"] > 0
    assert set(line["finish_reason"].split(",")) == finish_reasons
    assert 0 < line["ttft_ms"] <= line["duration_ms"]
    # the engine runs it under an id holding the request id (its own log lines name it)
    assert line["engine_id"] == response_id and line["request_id"] in line["engine_id"]


def test_chat_non_streamed_with_a_client_id(srv):
    r = call(srv, "POST", "/v1/chat/completions", chat_body(srv), request_id="client-req.1:a")
    assert r.status_code == 200, r.text
    line = access_line(srv, r)
    assert line["method"] == "POST" and line["route"] == "/v1/chat/completions"
    assert_ran(line, r.json()["usage"], {c["finish_reason"] for c in r.json()["choices"]}, r.json()["id"])
    assert r.json()["id"].startswith("chatcmpl-client-req.1:a.")  # a client id may repeat: the engine's is unique


def test_chat_streamed_with_a_generated_id(srv):
    r = call(srv, "POST", "/v1/chat/completions", chat_body(srv, stream=True, n=2,
                                                            stream_options={"include_usage": True}))
    chunks = stream_payloads(r)
    reasons = {c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
    line = access_line(srv, r)
    assert_ran(line, chunks[-1]["usage"], reasons, chunks[0]["id"])
    assert chunks[0]["id"] == f"chatcmpl-{r.headers['x-request-id']}"  # a generated id is the engine's as is


def test_completions_both_ways(srv):
    body = {"model": srv.model, "prompt": ["The sea is", "Ships are"], "max_tokens": 5}
    r = call(srv, "POST", "/v1/completions", body, request_id="cmpl-from-client")
    assert r.status_code == 200, r.text
    assert_ran(access_line(srv, r), r.json()["usage"], {c["finish_reason"] for c in r.json()["choices"]},
               r.json()["id"])
    r = call(srv, "POST", "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = stream_payloads(r)
    reasons = {c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
    assert_ran(access_line(srv, r), chunks[-1]["usage"], reasons, chunks[0]["id"])


def test_messages_and_responses_apis(srv):
    r = call(srv, "POST", "/v1/messages", {"model": srv.model, "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "Hello there"}]},
             key=None, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    line, used = access_line(srv, r), r.json()["usage"]
    assert line["tenant"] == "alpha" and line["route"] == "/v1/messages"
    assert line["prompt_tokens"] == used["input_tokens"] + used["cache_read_input_tokens"] + \
        used["cache_creation_input_tokens"]
    assert line["cached_tokens"] == used["cache_read_input_tokens"] and line["generated_tokens"] == used["output_tokens"]
    r = call(srv, "POST", "/v1/responses", {"model": srv.model, "input": "Hello there", "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    line, used = access_line(srv, r), r.json()["usage"]
    assert line["prompt_tokens"] == used["input_tokens"] and line["generated_tokens"] == used["output_tokens"]
    assert line["cached_tokens"] == used["input_tokens_details"]["cached_tokens"] and line["finish_reason"] == "length"


def test_a_client_that_leaves_mid_stream_gets_its_line(srv):
    srv.hold.clear()
    try:
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=chat_body(srv, stream=True, max_tokens=50),
                          headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "leaves-early"},
                          timeout=60) as r:
            assert r.headers["x-request-id"] == "leaves-early"
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break  # a token came: leave (the connection closes unread)
        srv.sent.append(r)
        line = access_line(srv, r)
    finally:
        srv.hold.set()
    assert line["status"] == 200 and line["finish_reason"] == "cancelled" and line["tenant"] == "alpha"
    assert 1 <= line["generated_tokens"] < 50 and line["ttft_ms"] <= line["duration_ms"]


def test_errors_and_routes_without_the_engine(srv):
    r = call(srv, "GET", "/no/such/route?api_key=query-secret-value", request_id="not found!")  # invalid id
    line = access_line(srv, r)
    assert r.status_code == 404 and line["status"] == 404 and line["route"] == "/no/such/route"
    assert line["tenant"] == "-" and line["request_id"] != "not found!"
    r = call(srv, "POST", "/v1/chat/completions", chat_body(srv), key="sk-wrong-key")
    assert r.status_code == 401 and access_line(srv, r)["tenant"] == "-" and access_line(srv, r)["status"] == 401
    r = call(srv, "POST", "/v1/chat/completions", {"model": srv.model, "max_tokens": 2}, request_id="x" * 129)
    line = access_line(srv, r)
    assert r.status_code == 400 and line["status"] == 400 and line["tenant"] == "alpha"
    assert line["prompt_tokens"] is None and line["finish_reason"] is None and line["ttft_ms"] is None
    r = call(srv, "POST", "/v1/completions", content=b"{" + b" " * 20000 + b"}",
             headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and access_line(srv, r)["status"] == 413
    r = call(srv, "GET", "/health", key=None)
    assert r.status_code == 200 and access_line(srv, r)["tenant"] == "-"


def test_an_unhandled_error_has_its_id_line_and_header(srv):
    check_model = srv.serving.check_model

    def boom(model: str) -> None:
        raise RuntimeError("boom")

    srv.serving.check_model = boom
    try:
        r = call(srv, "POST", "/v1/chat/completions", chat_body(srv), request_id="will-fail")
    finally:
        srv.serving.check_model = check_model
    assert r.status_code == 500 and access_line(srv, r)["status"] == 500
    # the server's own line about it names the request
    assert any(rec.getMessage() == "unhandled error" and rec.request_id == "will-fail" for rec in srv.records.records)


def test_one_access_line_per_request_and_no_secrets(srv):
    from server.access_log import FIELDS

    time.sleep(0.2)  # the last line is written after its response went out
    ids = [r.headers["x-request-id"] for r in srv.sent]
    assert len(ids) == len(set(ids)) >= 10
    logged = [rec.fields for rec in srv.records.access()]
    startup = [f for f in logged[:len(logged) - len(ids)]]  # the fixture's wait for /health
    assert all(f["route"] == "/health" and f["status"] == 200 for f in startup)
    assert sorted(f["request_id"] for f in logged[len(startup):]) == sorted(ids)
    lines = srv.stream.getvalue().splitlines()
    parsed = [json.loads(line) for line in lines]  # --log-format json: every line is JSON
    access = [p for p in parsed if p["logger"] == "kvserve.access"]
    assert len(access) == len(logged) and all(set(FIELDS) <= set(p) for p in access)
    assert all({"ts", "level", "message"} <= set(p) for p in parsed)
    # and the text format of the same records
    from server.access_log import TextFormatter

    text = "\n".join(TextFormatter().format(rec) for rec in srv.records.records)
    assert f"request_id={ids[0]} tenant=alpha method=POST route=/v1/chat/completions status=200" in text
    secrets = [KEY, hashlib.sha256(KEY.encode()).hexdigest(), SALT, "query-secret-value", "Say something"]
    for where, out in (("json lines", srv.stream.getvalue()), ("text lines", text)):
        for secret in secrets:
            assert secret not in out, f"{secret!r} in the {where}"


def test_log_format_flag_and_config(monkeypatch):
    from engine.config import EngineConfig
    from engine.core.process_client import MPEngineClient
    from kvserve import cli
    from server.config import ServerConfig

    assert ServerConfig().log_format == "text"
    for bad in (lambda: ServerConfig(log_format="xml"), lambda: MPEngineClient(EngineConfig(), log_format="xml")):
        with pytest.raises(ValueError, match="log_format"):
            bad()
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(["serve", "--log-format", "json"]) == 0
    assert seen["args"].log_format == "json"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--log-format", "xml"])
