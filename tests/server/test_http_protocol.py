"""Raw HTTP: SSE framing, status codes and error bodies, malformed input, body limits, auth, misc routes."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import parse_sse

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "Say hello."}]


def chat_body(live_server, **extra):
    return {"model": live_server.model, "messages": MSGS, "max_tokens": 4, "temperature": 0, **extra}


def assert_error(r: httpx.Response, status: int, schemas, param: str | None = "<any>", code: str | None = "<any>"):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    schemas.validate("ErrorResponse", body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param != "<any>":
        assert body["error"]["param"] == param, body
    if code != "<any>":
        assert body["error"]["code"] == code, body
    return body["error"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_sse_framing(http, live_server, openai_schemas, endpoint):
    if endpoint == "chat":
        url, body = "/v1/chat/completions", chat_body(live_server, max_tokens=6, stream=True)
    else:
        url, body = "/v1/completions", {"model": live_server.model, "prompt": "Hello, my name is", "max_tokens": 6,
                                        "temperature": 0, "stream": True}
    with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode("utf-8")
    chunks = parse_sse(raw)
    assert chunks
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(reason is None for reason in reasons[:-1]) and reasons[-1] in ("stop", "length")
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    if endpoint == "chat":
        for c in chunks:
            openai_schemas.validate("CreateChatCompletionStreamResponse", c)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        assert all(c["object"] == "text_completion" and isinstance(c["choices"][0]["text"], str) for c in chunks)


def test_malformed_json_is_400_not_422(http, openai_schemas):
    for raw in (b"{bad json", b'{"model": "x",', b"", b"\xff\xfe"):
        r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, openai_schemas)
    r = http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_error(r, 400, openai_schemas)


def test_wrong_types_name_the_param(http, live_server, openai_schemas):
    cases = [
        ("/v1/chat/completions", {"model": live_server.model, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", chat_body(live_server, max_tokens="x"), "max_tokens"),
        ("/v1/chat/completions", chat_body(live_server, temperature="hot"), "temperature"),
        ("/v1/chat/completions", chat_body(live_server, n=0), "n"),
        ("/v1/chat/completions", chat_body(live_server, top_logprobs=3), "top_logprobs"),
        # OpenAI refuses stream_options without stream (and so does vLLM)
        ("/v1/chat/completions", chat_body(live_server, stream_options={"include_usage": True}), "stream_options"),
        ("/v1/completions", {"model": live_server.model, "prompt": "hi", "stream": False,
                             "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"model": live_server.model, "messages": []}, "messages"),
        ("/v1/completions", {"model": live_server.model, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"model": live_server.model, "prompt": []}, "prompt"),
        # union-typed fields: the param is the field, not pydantic's name for one alternative
        ("/v1/completions", {"model": live_server.model, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": live_server.model, "prompt": "hi", "stop": 5}, "stop"),
        ("/v1/chat/completions", {"model": live_server.model, "messages": [{"role": "user", "content": 5}]},
         "messages.0.content"),
    ]
    for url, body, param in cases:
        err = assert_error(http.post(url, json=body), 400, openai_schemas, param=param)
        assert err["type"] == "invalid_request_error"
        assert param in err["message"] or param == "prompt", err


def test_values_of_the_wrong_json_type_are_refused_as_openai_schema_refuses_them(http, live_server,
                                                                                 openai_schemas):
    """A string, a boolean or null where OpenAI's schema wants a number, a boolean or content is a
    400 naming the field, not coerced (pydantic's lax mode had served ``max_tokens: true`` as 1)."""
    def chat(**extra):
        return "/v1/chat/completions", "CreateChatCompletionRequest", chat_body(live_server, **extra)

    def completion(**extra):
        return "/v1/completions", "CreateCompletionRequest", {"model": live_server.model, "prompt": "hi",
                                                              "max_tokens": 2, **extra}
    refused = [
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(temperature="0.5"), "temperature"),
        (chat(n="2"), "n"),
        (chat(seed="1"), "seed"),
        (chat(stream="true"), "stream"),
        (chat(logprobs=1), "logprobs"),
        (chat(logprobs=True, top_logprobs="2"), "top_logprobs"),
        (chat(logit_bias={"5": "1"}), "logit_bias.5"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (chat(parallel_tool_calls="no"), "parallel_tool_calls"),
        (chat(messages=[{"role": "user", "content": None}]), "messages.0.content"),
        (chat(messages=[{"role": "user"}]), "messages.0.content"),
        (chat(messages=[{"role": "system", "content": None}, *MSGS]), "messages.0.content"),
        (chat(messages=[*MSGS, {"role": "tool", "content": None, "tool_call_id": "c"}]), "messages.1.content"),
        (chat(messages=[{"role": "user", "content": "a", "name": 5}]), "messages.0.name"),
        (completion(max_tokens="5"), "max_tokens"),
        (completion(echo="true"), "echo"),
        (completion(logprobs=True), "logprobs"),
    ]
    for (url, schema, body), param in refused:
        assert openai_schemas.errors(schema, body), f"OpenAI's schema accepts {body}"
        err = assert_error(http.post(url, json=body), 400, openai_schemas, param=param)
        assert param in err["message"], err
    # what the schema accepts still serves: an integral float is an integer, an int a number,
    # and an assistant turn may leave its content out
    accepted = [chat(max_tokens=2.0, temperature=0, top_p=1),
                chat(messages=[*MSGS, {"role": "assistant", "content": None}, *MSGS]),
                completion(prompt=[1.0, 2.0], max_tokens=2.0)]
    for url, schema, body in accepted:
        openai_schemas.validate(schema, body)
        r = http.post(url, json=body)
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= body["max_tokens"], r.json()
    assert http.get("/health").status_code == 200


def test_missing_model_is_400(http, openai_schemas):
    err = assert_error(http.post("/v1/chat/completions", json={"messages": MSGS}), 400, openai_schemas,
                       param="model")
    assert "model" in err["message"]


def test_unknown_model_is_404(http, openai_schemas):
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS}), 404, openai_schemas,
                 param="model", code="model_not_found")


def test_unknown_extra_fields_are_accepted(http, live_server, openai_schemas):
    body = chat_body(live_server, some_future_field={"nested": [1, 2]}, parallel_tool_calls=True,
                     metadata={"k": "v"}, store=False)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    openai_schemas.validate("CreateChatCompletionResponse", r.json())


def test_body_over_limit_is_413(http, live_server, openai_schemas):
    limit = live_server.app.state.serving.config.max_body_bytes
    payload = json.dumps({"model": live_server.model, "prompt": "x" * (limit + 10)}).encode()
    r = http.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
    assert_error(r, 413, openai_schemas, code="request_too_large")

    def chunked():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(payload), 64 * 1024):
            yield payload[i:i + 64 * 1024]

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, openai_schemas, code="request_too_large")
    # Just under the limit is served.
    ok = json.dumps({"model": live_server.model, "prompt": "hi", "max_tokens": 1, "pad": "y" * (limit - 200)}).encode()
    assert len(ok) <= limit
    r = http.post("/v1/completions", content=ok, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_auth(live_server, openai_schemas):
    body = {"model": live_server.model, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=live_server.base_url, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": live_server.api_key},
                        {"Authorization": f"Basic {live_server.api_key}"}):
            assert_error(anon.post("/v1/completions", json=body, headers=headers), 401, openai_schemas,
                         code="invalid_api_key")
        assert_error(anon.get("/v1/models"), 401, openai_schemas)
        # auth is checked before the body is parsed
        assert_error(anon.post("/v1/completions", content=b"{bad"), 401, openai_schemas)
        # /health and /version are open (probes carry no key)
        assert anon.get("/health").status_code == 200
        assert anon.get("/version").status_code == 200


def test_unknown_path_is_404_in_error_shape(http, openai_schemas):
    assert_error(http.get("/v1/nope"), 404, openai_schemas)
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    openai_schemas.validate("ErrorResponse", r.json())


def test_health_and_version(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    from server import __version__

    r = http.get("/version")
    assert r.status_code == 200 and r.json()["version"] == __version__


def test_schema_validation_can_fail(openai_schemas):
    """The validators are not vacuous: a non-OpenAI finish_reason and a partial error body are rejected."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    openai_schemas.validate("CreateChatCompletionStreamResponse", chunk)
    chunk["choices"][0]["finish_reason"] = "abort"
    assert openai_schemas.errors("CreateChatCompletionStreamResponse", chunk)
    assert openai_schemas.errors("ErrorResponse", {"error": {"message": "m", "type": "t"}})
    assert openai_schemas.errors("CreateCompletionResponse", {"id": "x"})
    full = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "logprobs": None,
                         "finish_reason": "stop"}]}
    assert openai_schemas.errors("CreateChatCompletionResponse", full)  # message.refusal is required
