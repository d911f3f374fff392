"""Tool calls: the Hermes parser on model-like text, and tool_choice none / auto / required /
named end to end through the openai SDK (streamed and not), with a tool result turn."""
from __future__ import annotations

import json

import jsonschema
import pytest

from server.tools import ToolStreamSplitter, parse_tool_calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


# ---- the parser (no model) ----------------------------------------------------------------------
def test_parser_on_model_like_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}  # arguments given as a JSON string
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")


def test_parser_keeps_what_is_not_a_call():
    assert parse_tool_calls("Just prose.") == ("Just prose.", [])
    content, calls = parse_tool_calls("<tool_call>{not json}</tool_call> done")
    assert calls == [] and "<tool_call>" in content
    # unterminated last block (EOS right after the JSON) still counts
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert content is None and calls[0].name == "add"


def test_stream_splitter_holds_back_a_partial_tag():
    s = ToolStreamSplitter()
    out = s.feed("Hello <tool") + s.feed("_ca")
    assert out == "Hello "
    out += s.feed('ll>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    rest, calls = s.finish()
    assert out + rest == "Hello " and calls[0].name == "add"
    s = ToolStreamSplitter()
    assert s.feed("a <to") == "a " and s.feed("day") == "<today" and s.finish() == ("", [])


# ---- end to end ---------------------------------------------------------------------------------
pytestmark_slow = pytest.mark.slow


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytestmark_slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate(client, live_server, openai_schemas, choice):
    r = client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=80, temperature=0, parallel_tool_calls=False)
    openai_schemas.validate("CreateChatCompletionResponse", r.model_dump(mode="json", exclude_unset=True))
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    _check_calls(r.choices[0].message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    else:
        assert len(r.choices[0].message.tool_calls) == 1  # parallel_tool_calls=False


@pytestmark_slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_stream(client, live_server, openai_schemas, choice):
    chunks = list(client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS,
                                                 tool_choice=choice, max_tokens=80, temperature=0, stream=True,
                                                 parallel_tool_calls=False))
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", c.model_dump(mode="json", exclude_unset=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or d.id
            if d.function and d.function.name:
                entry["name"] = d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and all(e["id"] and e["name"] for e in calls.values())
    for e in calls.values():
        jsonschema.validate(json.loads(e["arguments"]), SCHEMAS[e["name"]])


@pytestmark_slow
def test_auto_goes_through_the_parser(client, live_server):
    """With tool_choice auto the tools are in the prompt and the output is parsed: either the
    model called (then tool_calls validate, finish_reason tool_calls) or it answered in prose
    that holds no call markup."""
    messages = [{"role": "system", "content": "Always call a function when one fits."}, *ASK]
    r = client.chat.completions.create(model=live_server.model, messages=messages, tools=TOOLS, tool_choice="auto",
                                       max_tokens=80, temperature=0)
    prompt_tokens = r.usage.prompt_tokens
    plain = client.chat.completions.create(model=live_server.model, messages=messages, max_tokens=1, temperature=0)
    assert prompt_tokens > plain.usage.prompt_tokens + 50  # the tools were rendered into the prompt
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert "<tool_call>" not in (message.content or "") or r.choices[0].finish_reason == "length"
    none = client.chat.completions.create(model=live_server.model, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=1, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # none: tools not shown


@pytestmark_slow
def test_tool_result_continues_the_conversation(client, live_server):
    first = client.chat.completions.create(model=live_server.model, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    r = client.chat.completions.create(model=live_server.model, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    rendered = live_server.engine.tokenizer.decode(
        __import__("httpx").post(f"{live_server.base_url}/tokenize", headers=live_server.headers,
                                 json={"messages": messages}).json()["tokens"])
    assert "<tool_response>" in rendered and "<tool_call>" in rendered and "sunny" in rendered


@pytestmark_slow
def test_bad_tool_choice_is_a_400(live_server):
    import httpx

    for choice, param in [({"type": "function", "function": {"name": "nope"}}, "tool_choice")]:
        r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={
            "model": live_server.model, "messages": ASK, "tools": TOOLS, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={
        "model": live_server.model, "messages": ASK, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


@pytestmark_slow
@pytest.mark.parametrize("choice", [None, "none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_that_cannot_compile_is_a_400_under_any_tool_choice(live_server, choice):
    import httpx

    bogus = [TOOLS[1], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]
    body = {"model": live_server.model, "messages": ASK, "tools": bogus, "max_tokens": 2}
    r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers,
                   json=body if choice is None else {**body, "tool_choice": choice})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "'f'" in error["message"] and "bogus" in error["message"]
