"""``/v1/responses`` through the real server: the official ``openai`` SDK's ``responses.create`` /
``stream`` / ``retrieve`` / ``delete``, tool calls, continuation through the store and the
prefix cache, error shapes, and the field table's docs.

Every response (and every stream event) is also validated against the SDK's own pydantic
models, which are the published shape of the API.
"""
from __future__ import annotations

import json
import logging

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import TypeAdapter

from server.responses.fields import RESPONSES_FIELDS, markdown_table
from tests.server.conftest import REPO

pytestmark = pytest.mark.slow

PROMPT = ("You are a helpful assistant in a long conversation about geography. Keep every answer short, "
          "friendly and accurate. Question: what is the capital of France?")
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                                           "unit": {"type": "string", "enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}
EVENT = TypeAdapter(ResponseStreamEvent)


def wire(obj) -> dict:
    return obj.model_dump(mode="json", exclude_unset=True)


def post(live_server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{live_server.v1}/responses", headers=kwargs.pop("headers", live_server.headers), json=body,
                      timeout=60, **kwargs)


def sse_events(raw: str) -> list[dict]:
    """``event: <type>`` + ``data: <json>`` frames, the type named twice and equal."""
    events = []
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        events.append(payload)
    return events


def test_create_text(client, live_server):
    r = client.responses.create(model=live_server.model, input=PROMPT, max_output_tokens=8, temperature=0)
    Response.model_validate(wire(r))
    assert r.id.startswith("resp_") and r.object == "response" and r.model == live_server.model
    assert r.status in ("completed", "incomplete") and r.error is None
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.output_text
    assert 0 < r.usage.output_tokens <= 8 and r.usage.input_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.truncation == "disabled" and r.store is True
    assert r.tool_choice == "auto" and r.tools == [] and r.text.format.type == "text"


def test_items_input_and_instructions(client, live_server):
    r = client.responses.create(
        model=live_server.model, instructions="Answer in one word.", max_output_tokens=6, temperature=0,
        input=[{"role": "developer", "content": "Be terse."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"role": "user", "content": "Name a color."}])
    assert r.instructions == "Answer in one word." and r.output_text


def test_stream_events_and_final_response(client, live_server):
    kwargs = dict(model=live_server.model, input=PROMPT, max_output_tokens=10, temperature=0)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if full.status == "completed" else "response.incomplete")
    assert types[2:-1] == ["response.output_item.added", "response.content_part.added",
                           *["response.output_text.delta"] * (len(types) - 8),
                           "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    final = events[-1].response
    Response.model_validate(wire(final))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == full.output_text
    assert [e for e in events if e.type == "response.output_text.done"][0].text == text
    assert final.status == full.status and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    assert wire(client.responses.retrieve(final.id)) == wire(final)

    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper_final = stream.get_final_response()
    assert "".join(deltas) == helper_final.output_text == full.output_text


def test_stream_wire_format(live_server):
    with httpx.stream("POST", f"{live_server.v1}/responses", headers=live_server.headers, timeout=60,
                      json={"model": live_server.model, "input": "Hi", "max_output_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = sse_events(raw)
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    Response.model_validate(events[-1]["response"])


def test_retrieve_and_delete(client, live_server):
    r = client.responses.create(model=live_server.model, input="Hi", max_output_tokens=4)
    assert wire(client.responses.retrieve(r.id)) == wire(r)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=live_server.model, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_hits_the_prefix_cache(client, live_server):
    first = client.responses.create(model=live_server.model, input=PROMPT, max_output_tokens=8, temperature=0)
    second = client.responses.create(model=live_server.model, previous_response_id=first.id,
                                     input="And the capital of Italy?", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # the same conversation sent whole renders the same prompt
    whole = client.responses.create(model=live_server.model, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the capital of Italy?"}])
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_forced_function_call_and_its_output(client, live_server):
    r = client.responses.create(model=live_server.model, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                temperature=0)
    Response.model_validate(wire(r))
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"

    follow = client.responses.create(model=live_server.model, previous_response_id=r.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature": 21, "unit": "C"}'}],
                                     max_output_tokens=8, temperature=0)
    Response.model_validate(wire(follow))
    assert follow.status in ("completed", "incomplete") and follow.output
    assert follow.usage.input_tokens_details.cached_tokens > 0

    streamed = list(client.responses.create(model=live_server.model, input="What is the weather in Paris?",
                                            tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=40, temperature=0, stream=True))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == streamed[-1].response.output[0].arguments == call.arguments


def test_json_schema_output_parses(client, live_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    r = client.responses.create(model=live_server.model, input="Give me a JSON object about Paris.",
                                max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_hosted_tools_are_dropped_and_named(live_server, caplog):
    caplog.set_level(logging.INFO, logger="server.responses.serving")
    body = {"model": live_server.model, "input": "Hi", "max_output_tokens": 4,
            "tools": [{"type": "web_search"}, WEATHER,
                      {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                       "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "store": False, "prompt_cache_key": "k",
            "client_metadata": {"x": "y"}, "metadata": {"a": "b"}, "user": "u"}
    r = post(live_server, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvserve-dropped-tools"] == "web_search"
    out = Response.model_validate(r.json())
    assert [t.name for t in out.tools] == ["get_weather", "spawn_agent"] and out.metadata == {"a": "b"}
    assert any("web_search" in rec.getMessage() for rec in caplog.records)
    with httpx.stream("POST", f"{live_server.v1}/responses", headers=live_server.headers, timeout=60,
                      json={**body, "stream": True}) as s:
        assert s.headers["x-kvserve-dropped-tools"] == "web_search"
        s.read()
    assert "x-kvserve-dropped-tools" not in post(live_server, {"model": live_server.model, "input": "Hi",
                                                               "max_output_tokens": 2}).headers


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0.message.role"),  # the item type is named in the path
    ({"input": [{"type": "image_generation_call"}]}, "input.0"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "temperature": "0.5"}, "temperature"),
    ({"input": "x", "stream": "true"}, "stream"),
    ({"input": "x", "store": 1}, "store"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools.0.function.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": []}, "input"),
])
def test_bad_requests_name_the_field(live_server, body, param):
    r = post(live_server, {"model": live_server.model, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split(".")[0] in \
        error["message"] + param, error


def test_unknown_previous_response_id_is_404(client, live_server):
    r = post(live_server, {"model": live_server.model, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
    assert "resp_nope" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=live_server.model, input="x", previous_response_id="resp_nope")
    assert httpx.get(f"{live_server.v1}/responses/resp_nope", headers=live_server.headers).status_code == 404


def test_auth(live_server):
    body = {"model": live_server.model, "input": "x", "max_output_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = post(live_server, body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(f"{live_server.v1}/responses/resp_x").status_code == 401


def test_unknown_model_is_404(live_server):
    r = post(live_server, {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_field_table_covers_the_sdk_and_the_docs():
    sdk = set(ResponseCreateParamsBase.__annotations__) | {"stream", "client_metadata"}
    assert {r.name for r in RESPONSES_FIELDS} == sdk
    docs = (REPO / "docs" / "api.md").read_text()
    assert markdown_table() in docs, "docs/api.md's /v1/responses table is stale: regenerate it"
