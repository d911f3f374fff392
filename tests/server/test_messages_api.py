"""Anthropic's Messages API through the real server: the official ``anthropic`` SDK (create,
stream, count_tokens, tools, cache_control), the SSE events on the wire, error shapes and auth."""
from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from server.messages.fields import MESSAGES_FIELDS, markdown_table
from server.messages.protocol import CountTokensRequest, MessagesRequest
from tests.server.conftest import REPO

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
COLD = {"temperature": 0}  # the SDK 2.x has no sampling arguments: sent in the body
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def claude(live_server):
    with anthropic.Anthropic(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0,
                             timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def raw(live_server):
    with httpx.Client(base_url=live_server.base_url, headers={"x-api-key": live_server.api_key}, timeout=60) as c:
        yield c


def sse_events(text: str) -> list[tuple[str, dict]]:
    """``event: <type>`` + ``data: <json>`` frames; each data's ``type`` equals its event name."""
    events = []
    for frame in text.split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    return events


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- the SDK --------------------------------------------------------------------------------
def test_create_text(claude, live_server):
    m = claude.messages.create(model=live_server.model, max_tokens=8, messages=ASK, extra_body=COLD)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == live_server.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 8
    assert m.usage.cache_creation_input_tokens == 0
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 8


def test_system_blocks_and_stop_sequences(claude, live_server):
    m = claude.messages.create(model=live_server.model, max_tokens=16, messages=ASK, extra_body=COLD,
                               system=[{"type": "text", "text": "You are terse."},
                                       {"type": "text", "text": "Answer in English."}],
                               stop_sequences=[" "])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " "
    assert " " not in text_of(m)


def test_stream_events_and_final_message(claude, live_server):
    kwargs = dict(model=live_server.model, max_tokens=10, messages=ASK, extra_body=COLD)
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta"
    assert "content_block_start" in types and types.index("content_block_start") < types.index("content_block_stop")
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == text_of(final) == text_of(full)
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens + full.usage.cache_read_input_tokens \
        - final.usage.cache_read_input_tokens
    anthropic.types.Message.model_validate(final.model_dump())


def test_wire_events_in_order(raw, live_server):
    r = raw.post("/v1/messages?beta=true", json={"model": live_server.model, "max_tokens": 6, "messages": ASK,
                                                 "stream": True, **COLD},
                 headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] <= 6


def test_max_tokens_beyond_the_context_is_clamped(raw, live_server):
    body = {"model": live_server.model, "max_tokens": 32000, "messages": ASK, "stream": True}
    with raw.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first == "event: message_start"  # then leave: the request is aborted


def test_count_tokens_equals_create(claude, live_server):
    kwargs = dict(model=live_server.model, messages=WEATHER_ASK, tools=TOOLS, system="Be brief.")
    counted = claude.messages.count_tokens(**kwargs)
    m = claude.messages.create(max_tokens=1, extra_body=COLD, **kwargs)
    u = m.usage
    assert counted.input_tokens == u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens > 20


def test_forced_tool_and_tool_result(claude, live_server):
    m = claude.messages.create(model=live_server.model, max_tokens=60, messages=WEATHER_ASK, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=COLD)
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)

    def turn(result):
        return WEATHER_ASK + [{"role": "assistant", "content": m.content},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                            "content": result}]}]

    after = claude.messages.create(model=live_server.model, max_tokens=12, messages=turn("Sunny, 21 C"), tools=TOOLS,
                                   tool_choice={"type": "none"}, extra_body=COLD)
    assert after.stop_reason in ("end_turn", "max_tokens") and text_of(after)
    # the result is in the prompt, whichever block shape it comes in
    counts = [claude.messages.count_tokens(model=live_server.model, messages=turn(result), tools=TOOLS).input_tokens
              for result in ("", "Sunny, 21 C", [{"type": "text", "text": "Sunny, 21 C"}])]
    assert counts[0] < counts[1] == counts[2]


def test_streamed_tool_use_equals_non_streamed(claude, live_server):
    kwargs = dict(model=live_server.model, max_tokens=60, messages=WEATHER_ASK, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                  extra_body=COLD)
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == full.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in full.content]


def test_cache_control_writes_then_reads(claude, live_server, http):
    system = [{"type": "text", "text": f"Session {uuid.uuid4().hex}. You are a meticulous assistant for a library "
                                       "catalogue; answer in one short sentence and cite the shelf code. " * 4,
               "cache_control": {"type": "ephemeral"}}]
    try:
        first = claude.messages.create(model=live_server.model, max_tokens=2, system=system, extra_body=COLD,
                                       messages=[{"role": "user", "content": "Where is Moby Dick?"}])
        assert first.usage.cache_creation_input_tokens > 0 and first.usage.cache_read_input_tokens == 0
        second = claude.messages.create(model=live_server.model, max_tokens=2, system=system, extra_body=COLD,
                                        messages=[{"role": "user", "content": "Where is Emma?"}])
        assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
        assert second.usage.cache_creation_input_tokens == 0
        counted = claude.messages.count_tokens(model=live_server.model, system=system,
                                               messages=[{"role": "user", "content": "Where is Emma?"}])
        u = second.usage
        assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    finally:  # leave no pin behind for other tests
        for pin in http.get("/v1/cache").json()["data"]:
            http.delete(f"/v1/cache/{pin['hash']}")


def test_request_level_cache_control_and_accepted_fields(claude, live_server, http):
    try:
        m = claude.messages.create(model=live_server.model, max_tokens=2, extra_body=COLD,
                                   cache_control={"type": "ephemeral"}, metadata={"user_id": "u-1"},
                                   thinking={"type": "disabled"}, service_tier="auto",
                                   output_config={"effort": "low"},
                                   messages=[{"role": "user", "content": f"{uuid.uuid4().hex} " * 12}],
                                   tools=TOOLS + [{"type": "web_search_20250305", "name": "web_search"}])
        assert m.usage.cache_creation_input_tokens > 0
    finally:
        for pin in http.get("/v1/cache").json()["data"]:
            http.delete(f"/v1/cache/{pin['hash']}")


def test_tool_breakpoint_without_system_pins_the_tools(claude, live_server, http):
    tools = [{**TOOLS[0], "description": f"Current weather in a city ({uuid.uuid4().hex})",
              "cache_control": {"type": "ephemeral"}}]
    try:
        m = claude.messages.create(model=live_server.model, max_tokens=1, tools=tools, messages=WEATHER_ASK,
                                   extra_body=COLD)
        assert m.usage.cache_creation_input_tokens > 0
    finally:
        for pin in http.get("/v1/cache").json()["data"]:
            http.delete(f"/v1/cache/{pin['hash']}")


# ---- the translation (no model) ---------------------------------------------------------------
def test_translation_of_turns_tools_and_breakpoints():
    from server.messages.translate import translate

    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "stop_sequences": ["END"], "top_k": 5,
        "system": [{"type": "text", "text": "A"},
                   {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "bash_20250124", "name": "bash"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                        "input": {"x": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "no"}], "is_error": True},
                                                  {"type": "text", "text": "and?"}]}]})
    t = translate(body, max_stop=4)
    chat = t.chat
    assert t.dropped_tools == ["bash (bash_20250124)"]
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].text() == "A\n\nB" and chat.messages[0].content[1].cache_control is not None
    assert chat.messages[2].content is None and chat.messages[2].tool_calls[0].function.arguments == '{"x": 1}'
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].text() == "Error: no"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 9
    assert [tool.function.name for tool in chat.tools] == ["f"]


def test_what_claude_code_sends_translates():
    """Claude Code 2.1's extras: a mid-conversation system turn (kept in its place), a tool with
    ``defer_loading`` (left out, as Anthropic keeps it out of the context until a tool search
    loads it) and ``thinking.display`` (accepted)."""
    from server.messages.translate import translate

    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 32000, "thinking": {"type": "adaptive", "display": "omitted"},
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Read", "input_schema": {"type": "object"}},
                  {"name": "DeferredToolPlaceholder", "input_schema": {"type": "object"}, "defer_loading": True}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
                     {"role": "user", "content": "go"}]})
    t = translate(body, max_stop=4)
    assert [m.role for m in t.chat.messages] == ["system", "user", "system", "user"]
    assert t.chat.messages[2].text() == "# Environment"
    assert [tool.function.name for tool in t.chat.tools] == ["Read"]
    assert t.dropped_tools == ["DeferredToolPlaceholder (defer_loading)"]


def test_a_dropped_tool_name_outside_latin_1_is_percent_encoded_in_the_header(raw, live_server):
    """Found by tests/server/test_fuzz_openapi.py: a server tool's name is the client's; one that
    latin-1 cannot encode made the x-kvserve-dropped-tools header a 500, and an empty first one
    (a value starting with a space) made h11 drop the connection without a response."""
    from urllib.parse import unquote

    name = "s\u00e9arch\U000427cd\r\n"
    r = raw.post("/v1/messages", json={"model": live_server.model, "max_tokens": 1, "messages": ASK,
                                       "tools": [{"type": "bash_20250124", "name": ""},
                                                 {"type": "web_search_20250305", "name": name}]})
    assert r.status_code == 200, r.text
    header = r.headers["x-kvserve-dropped-tools"]
    assert header.isascii() and header.isprintable() and header == header.strip()
    assert unquote(header) == f" (bash_20250124), {name} (web_search_20250305)"


def test_only_empty_turns_with_a_request_breakpoint_is_a_400():
    """Found by tests/server/test_fuzz_openapi.py: turns that all translate to nothing, under a
    top-level cache_control, were a 500 (IndexError marking the last of no messages)."""
    from server.errors import APIError
    from server.messages.translate import translate

    body = CountTokensRequest.model_validate({"model": "m", "cache_control": {"type": "ephemeral"},
                                              "messages": [{"role": "user", "content": []}]})
    with pytest.raises(APIError) as exc:
        translate(body, max_stop=4)
    assert exc.value.status == 400 and exc.value.param == "messages"


# ---- errors and auth --------------------------------------------------------------------------
def anthropic_error(r: httpx.Response, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


@pytest.mark.parametrize("change, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": 1}, "stream"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": [ASK[0], {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.1.content.0"),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
    ({"logprobs": True}, "logprobs"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages.0.content.0"),
])
def test_bad_input_is_400_naming_the_field(raw, live_server, change, field):
    body = {"model": live_server.model, "max_tokens": 4, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    message = anthropic_error(raw.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert field in message


def test_image_refused_by_the_sdk(claude, live_server):
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=live_server.model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])


def test_unknown_model_is_404(raw):
    message = anthropic_error(raw.post("/v1/messages", json={"model": "claude-x", "max_tokens": 4, "messages": ASK}),
                              404, "not_found_error")
    assert "claude-x" in message


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_body_over_the_limit_is_a_413_in_anthropics_shape(raw, live_server, claude, path):
    limit = live_server.app.state.serving.config.max_body_bytes
    payload = json.dumps({"model": live_server.model, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "x" * (limit + 10)}]}).encode()
    headers = {"content-type": "application/json"}
    message = anthropic_error(raw.post(path, content=payload, headers=headers), 413, "request_too_large")
    assert str(limit) in message

    def chunked():  # no Content-Length: the limit holds while reading, in the same shape
        for i in range(0, len(payload), 64 * 1024):
            yield payload[i:i + 64 * 1024]

    anthropic_error(raw.post(path, content=chunked(), headers=headers), 413, "request_too_large")
    if path == "/v1/messages":
        with pytest.raises(anthropic.APIStatusError) as caught:  # the SDK reads it as Anthropic's own
            claude.messages.create(model=live_server.model, max_tokens=1,
                                   messages=[{"role": "user", "content": "x" * (limit + 10)}])
        assert caught.value.status_code == 413 and caught.value.type == "request_too_large"


def test_auth_with_both_header_styles(live_server):
    body = {"model": live_server.model, "max_tokens": 1, "messages": ASK}
    url = f"{live_server.base_url}/v1/messages"
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        anthropic_error(httpx.post(url, json=body, headers=headers), 401, "authentication_error")
    for headers in ({"x-api-key": live_server.api_key}, {"Authorization": f"Bearer {live_server.api_key}"}):
        assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    count = f"{url}/count_tokens"
    anthropic_error(httpx.post(count, json={"model": live_server.model, "messages": ASK}), 401,
                    "authentication_error")
    with anthropic.Anthropic(base_url=live_server.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=live_server.model, max_tokens=1, messages=ASK)


def test_openai_routes_keep_their_error_shape(live_server):
    r = httpx.post(f"{live_server.v1}/chat/completions", json={"model": live_server.model, "messages": ASK},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---- the field table ----------------------------------------------------------------------------
def test_field_table_matches_the_model_and_the_docs():
    assert {f.name for f in MESSAGES_FIELDS} == set(MessagesRequest.model_fields)
    docs = (REPO / "docs" / "api.md").read_text()
    assert markdown_table() in docs, "docs/api.md's /v1/messages table is stale: regenerate it"
