"""The Responses API's parts without a server: the store's bounds, and the translation of
items and tools into a chat request."""
from __future__ import annotations

import pytest

from server.config import ResponseStoreConfig, ServerConfig
from server.errors import APIError
from server.responses.output import OutputBuilder, as_input_items
from server.responses.protocol import MessageItem, ResponsesRequest
from server.responses.store import ResponseStore
from server.responses.translate import translate


def stored(store: ResponseStore, rid: str, text: str = "x") -> bool:
    return store.put({"id": rid, "object": "response"}, [MessageItem(role="user", content=text)])


def test_store_evicts_least_recently_used_by_count():
    store = ResponseStore(ResponseStoreConfig(max_responses=2))
    stored(store, "a"), stored(store, "b")
    assert store.get("a") is not None  # a is now the most recently used
    stored(store, "c")
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_store_evicts_by_bytes_and_refuses_what_cannot_fit():
    store = ResponseStore(ResponseStoreConfig(max_bytes=400))
    assert stored(store, "a", "x" * 100) and stored(store, "b", "y" * 100)
    assert stored(store, "c", "z" * 100)
    assert store.get("a") is None and store.bytes <= 400
    assert not stored(store, "huge", "w" * 1000) and store.get("huge") is None
    assert store.delete("b") and not store.delete("b")
    assert store.bytes == store.get("c").size


def test_store_config_from_a_profile_and_its_checks():
    assert ServerConfig(response_store={"max_responses": 3}).response_store == ResponseStoreConfig(max_responses=3)
    with pytest.raises(ValueError):
        ResponseStoreConfig(max_bytes=-1)


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def test_items_become_chat_messages():
    body = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ], tools=[{"type": "function", "name": "f"}])
    messages = [m.model_dump(exclude_none=True) for m in translate(body, []).chat.messages]
    assert [m["role"] for m in messages] == ["system", "developer", "user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Be brief." and messages[2]["content"] == "ab"
    assert messages[3]["content"] == "calling" and [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert messages[5] == {"role": "tool", "content": "two", "tool_call_id": "c2"}


def test_history_comes_first_and_instructions_are_not_carried_over():
    history = [MessageItem(role="user", content="first"), *as_input_items(
        [{"type": "message", "content": [{"type": "output_text", "text": "answer"}]},
         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])]
    chat = translate(request(input="second", instructions="now"), history).chat
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "now"), ("user", "first"),
                                                          ("assistant", "answer"), ("user", "second")]
    assert chat.messages[2].tool_calls[0].id == "c"


def test_tools_are_flattened_and_hosted_ones_dropped():
    body = request(input="x", tools=[
        {"type": "web_search"}, {"type": "function", "name": "a", "parameters": {"type": "object"}},
        {"type": "namespace", "name": "ns", "description": "d",
         "tools": [{"type": "function", "name": "b"}, {"type": "custom", "name": "patch"}]},
        {"type": "image_generation"}, {"type": "web_search"}], tool_choice={"type": "function", "name": "b"},
        max_output_tokens=5, text={"format": {"type": "json_object"}}, parallel_tool_calls=False)
    t = translate(body, [])
    assert [f.name for f in t.tools] == ["a", "b"] and t.dropped == ["web_search", "custom", "image_generation"]
    assert [tool.function.name for tool in t.chat.tools] == ["a", "b"]
    assert t.chat.tool_choice.function.name == "b" and t.chat.parallel_tool_calls is False
    assert t.chat.max_completion_tokens == 5 and t.chat.response_format.type == "json_object"


def test_no_item_is_a_400_naming_input():
    with pytest.raises(APIError) as info:
        translate(request(input=[{"type": "reasoning"}]), [])
    assert info.value.param == "input"


def test_builder_items_and_events():
    b = OutputBuilder()
    events = [*b.feed({"content": "hi"}), *b.feed({"tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                            "arguments": "{}"}}]}),
              *b.finish(incomplete=False)]
    assert [e for e, _ in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [i["type"] for i in b.output] == ["message", "function_call"]
    assert all(i["status"] == "completed" for i in b.output)
    empty = OutputBuilder()
    list(empty.finish(incomplete=True))
    assert empty.output[0]["content"][0]["text"] == "" and empty.output[0]["status"] == "incomplete"
