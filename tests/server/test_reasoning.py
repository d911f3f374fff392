"""Reasoning output: the ``<think>`` splitter alone, detection from the tokenizer, and the split on
all three chat-shaped endpoints (chat completions, Responses, Messages), streamed and not.

The server runs a tiny random-weight model with the default model's tokenizer and a chat template
that marks thinking (as DeepSeek-R1's and Qwen3's do). Its output is forced by a regex grammar
(the real grammar path): chat completions take ``guided_regex`` directly; Responses and Messages
have no such field, so the test wraps the engine client's ``generate`` to give every request the
same grammar. A model without think tags is covered by the existing conformance tests
(``tests/server/test_openai_sdk.py``, ``test_vendored_spec.py``), which pin its chunks unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import anthropic
import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvtypes.structured_spec import StructuredOutputSpec
from server.reasoning import CLOSE, OPEN, ReasoningParser, ThinkMode, split, think_tags
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
from tests.server.conftest import parse_sse

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and '</think>' in (m.content or '') %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if open_think is defined and open_think or messages[0].content == 'open_think' %}<think>\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")

REASONING, ANSWER = "\nthinking hard\n", "the answer"
FORCED = f"<think>{REASONING}</think>\n\n{ANSWER}"
USER = [{"role": "user", "content": "What is the answer?"}]


# ---- the splitter alone ----------------------------------------------------------------------
def _feed_in_pieces(text: str, cuts: tuple[int, ...], inside: bool,
                    tagless: bool) -> tuple[str, str, bool]:
    parser, reasoning, content, last = ReasoningParser(inside), "", "", 0
    for cut in (*cuts, len(text)):
        r, c = parser.feed(text[last:cut])
        for side in (r, c) if tagless else ():  # no piece of a tag reaches either side
            assert OPEN not in side and CLOSE not in side
        reasoning, content, last = reasoning + r, content + c, cut
    r, c = parser.finish()
    return reasoning + r, content + c, parser.opened


@pytest.mark.parametrize("text,inside,want", [
    (FORCED, False, (REASONING, ANSWER)),
    ("  <think>a</thi b</think>  c</think>", False, ("a</thi b", "c</think>")),
    ("plain answer, no tags", False, (None, "plain answer, no tags")),
    (" <thinking> is not the tag", False, (None, " <thinking> is not the tag")),
    ("reasoned already</think>\nanswer", True, ("reasoned already", "answer")),
    ("<think>cut by max_tokens </thi", False, ("cut by max_tokens </thi", "")),
])
def test_splitter_at_every_pair_of_cut_points(text, inside, want):
    assert split(text, ThinkMode(inside)) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            tagless = not any(tag in side for side in want if side for tag in (OPEN, CLOSE))
            reasoning, content, opened = _feed_in_pieces(text, (i, j), inside, tagless)
            assert ((reasoning if opened else None), content) == want, (i, j)


def test_splitter_one_character_at_a_time():
    parser, out = ReasoningParser(), []
    for ch in FORCED:
        out.append(parser.feed(ch))
    out.append(parser.finish())
    assert "".join(r for r, _ in out) == REASONING and "".join(c for _, c in out) == ANSWER
    # every reasoning piece comes before the first content piece
    first_content = next(i for i, (_, c) in enumerate(out) if c)
    assert not any(r for r, _ in out[first_content:])


def test_reasoning_tokens_count_up_to_the_closing_tag():
    parser = ReasoningParser()
    for n, piece in enumerate(["<think>", "a", "b", "</think>", "\n", "x", "y"], start=1):
        parser.feed(piece, n)
    assert parser.reasoning_tokens == 4
    open_block = ReasoningParser(starts_inside=True)
    for n, piece in enumerate(["a", "b", "c"], start=1):
        open_block.feed(piece, n)
    assert open_block.reasoning_tokens == 3


# ---- detection -------------------------------------------------------------------------------
class _Tok:
    def __init__(self, template: str | None, added: dict[str, int] | None = None) -> None:
        self.chat_template, self._added = template, added or {}

    def get_added_vocab(self) -> dict[str, int]:
        return self._added


def test_think_tags_detected_from_template_or_tokens(tokenizer):
    assert think_tags(_Tok(THINK_TEMPLATE))
    assert think_tags(_Tok("{{ messages }}", {"</think>": 7}))
    assert not think_tags(_Tok("{{ messages }}", {"<|im_end|>": 2}))
    assert not think_tags(None)
    assert not think_tags(tokenizer), "the default model does not reason: its output must stay as it was"


# ---- the tiny think-tag model, served --------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)


@pytest.fixture(scope="module")
def server(tokenizer):
    from bench.server import start_inprocess
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    thinker = copy.deepcopy(tokenizer)
    thinker.chat_template = THINK_TEMPLATE
    config = tiny_llama_config(vocab_size=len(thinker), max_position_embeddings=512,
                               bos_token_id=thinker.bos_token_id, eos_token_id=thinker.eos_token_id,
                               pad_token_id=thinker.pad_token_id)
    engine = tiny_engine(tiny_hf_model(config), block_size=16, num_blocks=128, max_num_batched_tokens=256,
                         tokenizer=thinker)
    service = build_service(EngineConfig(), ServerConfig(log_stats_interval_s=0), engine=engine)
    client = service.engine
    forced = {"regex": None}

    def forcing(call):  # the grammar Responses / Messages cannot ask for, on generate and push alike
        def forced_call(prompt_ids, params, *args, **kwargs):
            if forced["regex"] is not None and params.structured_output is None:
                # the whole output, think block included, held by the grammar: no think-block state holds it back
                params = dataclasses.replace(params, structured_output=StructuredOutputSpec("regex", forced["regex"]),
                                             reasoning=None)
            return call(prompt_ids, params, *args, **kwargs)
        return forced_call

    client.generate, client.push = forcing(client.generate), forcing(client.push)
    srv = start_inprocess(service.app, service.engine.model_name)
    srv.force = forced
    yield srv
    srv.close()


@pytest.fixture
def forced(server):
    server.force["regex"] = _escape(FORCED)
    yield server
    server.force["regex"] = None


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    r = httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r


def _chat(server, stream: bool, **extra):
    return _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 64, "temperature": 0,
                                                  "guided_regex": _escape(FORCED), "stream": stream, **extra})


def test_chat_splits_reasoning_from_content(server):
    body = _chat(server, False).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == REASONING
    assert message["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_sends_reasoning_chunks_before_content(server):
    chunks = parse_sse(_chat(server, True).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = ["reasoning" if "reasoning_content" in d else "content" for d in deltas[1:] if d]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), kinds  # reasoning first, then content
    for d in deltas:
        if "reasoning_content" in d:
            assert d["reasoning"] == d["reasoning_content"] and "content" not in d
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_chat_prompt_that_opens_the_block(server):
    """R1's template ends the prompt with ``<think>``: the output starts inside the block (forced
    by the engine-side grammar, which the server does not see); a grammar of the request's own
    starts after ``</think>`` (vLLM's behaviour), so such a request keeps its thinking: here the
    random model never closes the block, so it is all reasoning, and with a budget the JSON follows."""
    server.force["regex"] = _escape(f"{REASONING}</think>\n\n{ANSWER}")
    try:
        for stream in (False, True):
            r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 64, "stream": stream,
                                                       "chat_template_kwargs": {"open_think": True}})
            if stream:
                deltas = [c["choices"][0]["delta"] for c in parse_sse(r.text) if c["choices"]]
                got = ("".join(d.get("reasoning_content", "") for d in deltas),
                       "".join(d.get("content") or "" for d in deltas))
            else:
                message = r.json()["choices"][0]["message"]
                got = (message["reasoning_content"], message["content"])
            assert got == (REASONING, ANSWER)
    finally:
        server.force["regex"] = None
    body = _post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 32, "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"open_think": True}}).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]


def test_chat_template_kwargs_reach_the_template(server):
    def prompt_tokens(**extra):
        return _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **extra}).json()[
            "usage"]["prompt_tokens"]

    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > prompt_tokens()
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": USER, "chat_template_kwargs": {"tokenize": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", bad.text


# ---- the reasoning budget ----------------------------------------------------------------------
BUDGET = 6
OPENED = {"chat_template_kwargs": {"open_think": True}}


def _chat_text(server, stream: bool, **extra) -> tuple[str | None, str, dict]:
    r = _post(server, "/v1/chat/completions", {"messages": USER, "temperature": 0, "ignore_eos": True,
                                               "stream": stream, **OPENED, **extra})
    if not stream:
        body = r.json()
        message = body["choices"][0]["message"]
        return message["reasoning_content"], message["content"] or "", body
    chunks = parse_sse(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content") or "" for d in deltas),
            chunks[-1])


@pytest.fixture(scope="module")
def free_thinking(server) -> str:
    """The block the model writes in BUDGET tokens unhindered (it never closes it itself)."""
    reasoning, content, body = _chat_text(server, False, max_tokens=BUDGET)
    assert content == "" and body["usage"]["completion_tokens"] == BUDGET
    return reasoning


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["thinking_token_budget", "max_reasoning_tokens"])
def test_chat_budget_closes_the_block_after_exactly_that_many_tokens(server, free_thinking, field, stream):
    reasoning, content, _ = _chat_text(server, stream, max_tokens=24, **{field: BUDGET})
    assert reasoning == free_thinking and content, (reasoning, content)  # the answer follows the forced tag
    reasoning, content, _ = _chat_text(server, stream, max_tokens=24)
    assert reasoning.startswith(free_thinking) and len(reasoning) > len(free_thinking) and content == ""


def test_chat_budget_then_the_grammar(server, free_thinking):
    """A structured request on a reasoning model thinks first; the grammar holds what follows ``</think>``."""
    reasoning, content, _ = _chat_text(server, False, max_tokens=24, thinking_token_budget=BUDGET,
                                       response_format={"type": "json_object"})
    assert reasoning == free_thinking and content.startswith('{"'), content
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for stream in (False, True):
        reasoning, content, last = _chat_text(server, stream, max_tokens=40, thinking_token_budget=BUDGET,
                                              ignore_eos=False, response_format={
                                                  "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        assert reasoning == free_thinking and last["choices"][0]["finish_reason"] == "stop", last
        assert list(json.loads(content)) == ["n"] and 0 <= json.loads(content)["n"] <= 9


def test_chat_budget_then_a_forced_tool_call(server):
    city = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
    for stream in (False, True):
        reasoning, _, _ = _chat_text(server, stream, max_tokens=BUDGET, tools=[city])  # the free block
        r = _post(server, "/v1/chat/completions", {
            "messages": USER, "temperature": 0, "max_tokens": 64, "thinking_token_budget": BUDGET, **OPENED,
            "tools": [city], "tool_choice": "required", "stream": stream})
        if stream:
            deltas = [c["choices"][0]["delta"] for c in parse_sse(r.text) if c["choices"]]
            got = "".join(d.get("reasoning_content", "") for d in deltas)
            calls = [c for d in deltas for c in d.get("tool_calls") or []]
        else:
            message = r.json()["choices"][0]["message"]
            got, calls = message["reasoning_content"], message["tool_calls"]
        assert got == reasoning and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", r.text
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("body,param", [({"thinking_token_budget": -1}, "thinking_token_budget"),
                                        ({"max_reasoning_tokens": "8"}, "max_reasoning_tokens"),
                                        ({"thinking_token_budget": 4, "max_reasoning_tokens": 5},
                                         "max_reasoning_tokens")])
def test_bad_budget_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": server.model, "messages": USER, **body})
    assert r.status_code == 400 and param in (r.json()["error"]["param"] or ""), r.text


def test_chat_output_without_a_block_has_null_reasoning(server):
    body = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 16,
                                                  "guided_regex": "plain"}).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "plain" and message["reasoning_content"] is None and message["reasoning"] is None


# ---- Responses ---------------------------------------------------------------------------------
EVENT = TypeAdapter(ResponseStreamEvent)


def _sse_events(raw: str) -> list[dict]:
    events = []
    for frame in raw.split("\n\n"):
        if frame:
            head, data = frame.split("\n")
            payload = json.loads(data[len("data: "):])
            assert payload["type"] == head[len("event: "):]
            events.append(payload)
    return events


def _check_response(response: dict) -> None:
    Response.model_validate(response)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    details = response["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < response["usage"]["output_tokens"]


def test_responses_reasoning_item_before_the_message(forced):
    r = _post(forced, "/v1/responses", {"input": "What is the answer?", "max_output_tokens": 64,
                                        "temperature": 0})
    _check_response(r.json())


def test_responses_stream_reasoning_text_events(forced):
    r = _post(forced, "/v1/responses", {"input": "What is the answer?", "max_output_tokens": 64,
                                        "temperature": 0, "stream": True})
    events = _sse_events(r.text)
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == REASONING and done["output_index"] == 0
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == ANSWER
    _check_response(events[-1]["response"])
    assert events[-1]["type"] == "response.completed"


def _opened_response(server, stream: bool, **extra) -> dict:
    """A response whose prompt opened the block (the template does so for instructions "open_think")."""
    r = _post(server, "/v1/responses", {"input": "What is the answer?", "instructions": "open_think",
                                        "temperature": 0, "stream": stream, **extra})
    if not stream:
        return r.json()
    events = _sse_events(r.text)
    for event in events:
        EVENT.validate_python(event)
    return events[-1]["response"]


def _texts(response: dict) -> tuple[str, str]:
    by_type = {item["type"]: item for item in response["output"]}
    reasoning = "".join(c["text"] for c in by_type["reasoning"]["content"])
    message = "".join(c["text"] for c in by_type["message"]["content"]) if "message" in by_type else ""
    return reasoning, message


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_max_tokens_caps_the_block_and_text_format_follows(server, tokenizer, stream):
    free = _opened_response(server, False, max_output_tokens=BUDGET)
    assert free["status"] == "incomplete" and _texts(free)[1] == ""
    capped = _opened_response(server, stream, max_output_tokens=24, reasoning={"max_tokens": BUDGET})
    end = len(tokenizer.encode(CLOSE, add_special_tokens=False))
    assert _texts(capped)[0] == _texts(free)[0] and _texts(capped)[1]
    assert capped["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET + end
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    structured = _opened_response(server, stream, max_output_tokens=40, reasoning={"max_tokens": BUDGET},
                                  text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    reasoning, text = _texts(structured)
    assert structured["status"] == "completed" and reasoning == _texts(free)[0] and list(json.loads(text)) == ["n"]


def test_responses_bad_reasoning_max_tokens_is_a_400(server):
    r = httpx.post(f"{server.url}/v1/responses", timeout=60,
                   json={"model": server.model, "input": "hi", "reasoning": {"max_tokens": -2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.max_tokens", r.text


# ---- Messages ----------------------------------------------------------------------------------
def _messages(server, **extra) -> httpx.Response:
    return _post(server, "/v1/messages", {"messages": USER, "max_tokens": 64, "temperature": 0, **extra})


def test_messages_thinking_block_first_when_asked(forced):
    for kind in ("enabled", "adaptive"):
        thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
        message = _messages(forced, thinking=thinking).json()
        anthropic.types.Message.model_validate(message)
        assert message["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                      {"type": "text", "text": ANSWER}]


def test_messages_without_thinking_drops_the_reasoning(forced):
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        message = _messages(forced, **extra).json()
        assert message["content"] == [{"type": "text", "text": ANSWER}]
        assert message["stop_reason"] == "end_turn"


def _message_events(raw: str) -> list[dict]:
    events = _sse_events(raw)
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for event in events:
        if event["type"] != "ping":
            adapter.validate_python(event)
    return events


def test_messages_stream_thinking_deltas(forced):
    events = _message_events(_messages(forced, stream=True, thinking={"type": "adaptive"}).text)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    kinds = [d["type"] for d in deltas]
    assert kinds == sorted(kinds, key=lambda k: k != "thinking_delta")
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == REASONING
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == ANSWER
    quiet = _message_events(_messages(forced, stream=True).text)
    assert not any(e.get("delta", {}).get("type") == "thinking_delta" for e in quiet)
    assert [e["content_block"]["type"] for e in quiet if e["type"] == "content_block_start"] == ["text"]


# The template opens the block for a system prompt of "open_think" (Messages has no template kwargs).
def _opened_message(server, stream: bool, **extra) -> tuple[list[dict], list[dict] | None]:
    r = _messages(server, system="open_think", stream=stream, **extra)
    if not stream:
        return r.json()["content"], None
    events = _message_events(r.text)
    blocks, deltas = [], []
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            deltas.append(e["delta"])
            key = {"thinking_delta": "thinking", "text_delta": "text"}.get(e["delta"]["type"])
            if key:
                blocks[e["index"]][key] += e["delta"][key]
    return blocks, deltas


@pytest.mark.parametrize("stream", [False, True])
def test_messages_budget_tokens_cap_the_thinking_block(server, stream):
    free, _ = _opened_message(server, False, max_tokens=BUDGET, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b["type"] for b in free] == ["thinking"]
    blocks, _ = _opened_message(server, stream, max_tokens=24, thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert [b["type"] for b in blocks] == ["thinking", "text"] and blocks[1]["text"], blocks
    assert blocks[0]["thinking"] == free[0]["thinking"]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_display_omitted_keeps_the_block_without_its_text(server, stream):
    thinking = {"type": "enabled", "budget_tokens": BUDGET}
    shown, _ = _opened_message(server, stream, max_tokens=24, thinking=thinking)
    blocks, deltas = _opened_message(server, stream, max_tokens=24, thinking={**thinking, "display": "omitted"})
    assert shown[0]["thinking"] and blocks[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert blocks[1:] == shown[1:]
    assert deltas is None or not any(d["type"] == "thinking_delta" for d in deltas)


def test_chat_extras_table_is_in_the_docs():
    from server.openai_fields import markdown_table
    from tests.server.conftest import REPO

    docs = (REPO / "docs" / "api.md").read_text()
    assert markdown_table("chat", extras=True) in docs, "docs/api.md's chat extras table is stale: regenerate it"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_tool_call(server, stream):
    """The content after the think block goes through the tool-call parser as any content does."""
    r = _post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 96, "tools": [WEATHER], "tool_choice": "auto", "stream": stream,
        "guided_regex": _escape(f"<think>{REASONING}</think>\n\n{CALL}")})
    if stream:
        deltas = [c["choices"][0]["delta"] for c in parse_sse(r.text) if c["choices"]]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        calls = [call for d in deltas for call in d.get("tool_calls") or []]
        content = "".join(d.get("content") or "" for d in deltas)
    else:
        message = r.json()["choices"][0]["message"]
        reasoning, calls, content = message["reasoning_content"], message["tool_calls"], message["content"] or ""
    assert reasoning == REASONING and content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]


@pytest.mark.slow
def test_a_model_without_think_tags_gets_no_reasoning_keys(live_server):
    """The default model's template has no tags: no new keys, streamed or not (its chunks are
    pinned by tests/server/test_vendored_spec.py and test_openai_sdk.py)."""
    body = {"model": live_server.model, "messages": USER, "max_tokens": 8, "temperature": 0}
    full = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json=body,
                      timeout=120).json()
    assert set(full["choices"][0]["message"]) == {"role", "content", "refusal"}
    raw = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={**body, "stream": True},
                     timeout=120).text
    chunks = [c for c in parse_sse(raw) if c["choices"]]
    assert all(set(c["choices"][0]["delta"]) <= {"role", "content"} for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        full["choices"][0]["message"]["content"]
