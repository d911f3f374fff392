"""Tool calls and JSON outputs that hold up on the default model (SmolLM2-135M-Instruct).

Ten prompts per case, greedy, through the real server (the session's ``live_server``), sent
together so that they decode as one batch: forced calls (``required`` and named) come back
parsed with finish ``tool_calls`` and, without ``parallel_tool_calls``, exactly one call; a
call cut by ``max_tokens`` still comes back parsed; ``auto`` never names an undeclared tool;
``json_object``, ``json_schema`` and the SDK's ``parse()`` end with ``stop`` well inside a
generous ``max_tokens`` (the grammar ends the output, not the budget). Also the pieces without
the model: the cut-output parser and the grammars ToolPlan compiles.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from server.tools import ToolPlan, ToolStreamer, finish_message, parse_tool_calls
from tests.server.test_tool_calls import SCHEMAS, TOOLS, WEATHER  # the same two tools

TOOL_PROMPTS = ["What is the weather in Paris right now?", "Is it raining in London?",
                "How warm is it in Tokyo today, in fahrenheit?", "What is 17 plus 25?", "Add 3 and 4 for me.",
                "Weather for Berlin please.", "I am going to Rome tomorrow, what should I wear?", "What's 120 + 7?",
                "Tell me the temperature in New York.", "Compute the sum of 1000 and 2345."]
JSON_PROMPTS = ["Give me a JSON object about Paris.", "Describe a cat as JSON.",
                "Give me a JSON object describing a book.",
                "Return a JSON object with facts about the Moon.", "Describe your favourite food as a JSON object.",
                "A JSON object about the planet Mars.", "Give me a JSON object for a user profile.",
                "Describe a car in JSON.", "Give me a JSON object about the city of Tokyo.", "Describe a dog as JSON."]
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"], "additionalProperties": False}
GENEROUS = 200  # tool calls need < 90 tokens
# JSON: json_object's worst prompt ("a user profile": six keys, each value a repeated
# "john_john_..." held to 64 characters) ends by the grammar at 247 tokens.
GENEROUS_JSON = 300


def _plan(mode="required", parallel=True, named=None) -> ToolPlan:
    return ToolPlan(mode, [dict(t) for t in TOOLS], named, parallel)


def _block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---- without the model ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_cut_output_keeps_its_whole_calls_and_drops_the_cut_one(mode):
    text = _block("add", {"a": 1, "b": 2}) + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    message, finish = finish_message(_plan(mode), text, "length")
    assert finish == "length"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert message["content"] is None  # no raw <tool_call> text


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_cut_stream_keeps_its_whole_calls_and_drops_the_cut_one(mode):
    streamer = ToolStreamer(_plan(mode))
    text = _block("add", {"a": 1, "b": 2}) + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    sent = [streamer.delta(text[i:i + 7]) for i in range(0, len(text), 7)]
    assert all(not d.get("content") for d in sent)
    tail, finish = streamer.final("length")
    assert finish == "length" and "content" not in tail
    assert [c["function"]["name"] for c in tail["tool_calls"]] == ["add"]


def test_a_cut_call_alone_is_neither_a_call_nor_content():
    message, finish = finish_message(_plan("required"), '<tool_call>\n{"name": "add", "argu', "length")
    assert finish == "length" and message["content"] is None and "tool_calls" not in message
    message, finish = finish_message(_plan("named", named="add"), '{"a": 1, "b', "length")
    assert finish == "length" and message["content"] is None and "tool_calls" not in message
    message, _ = finish_message(_plan("auto"), 'Let me see. <tool_call>\n{"na', "length")
    assert message["content"] == "Let me see." and "tool_calls" not in message


def test_undeclared_tools_and_repeats_are_not_calls():
    undeclared = _block("WAYTHEROCOPIA PROBSCARIA", {})
    message, finish = finish_message(_plan("auto"), undeclared, "stop")
    assert "tool_calls" not in message and finish == "stop"
    assert message["content"] == undeclared  # it stays what the model said
    repeated = "\n".join([_block("add", {"a": 1, "b": 2})] * 3)
    message, finish = finish_message(_plan("required"), repeated, "stop")
    assert len(message["tool_calls"]) == 1 and finish == "tool_calls"
    _, calls = parse_tool_calls(undeclared + _block("add", {"a": 1, "b": 2}), {"add"})
    assert [c.name for c in calls] == ["add"]


def test_the_number_of_calls_is_bounded():
    assert _plan(parallel=False).max_calls == 1
    assert _plan(parallel=True).max_calls == 2
    assert ToolPlan("required", [TOOLS[0]] * 20, parallel=True).max_calls == 8


# ---- the grammars, on the default model's tokenizer ------------------------------------------------
@pytest.fixture(scope="module")
def matcher(live_server):
    import llguidance
    import llguidance.hf

    from engine.sampling.structured_output import grammar_definition

    tokenizer = live_server.engine.tokenizer
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def feed(spec, text: str):
        m = llguidance.LLMatcher(ll, grammar_definition(spec), log_level=0)
        assert not m.is_error(), m.get_error()
        ok = all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok, m
    return feed


@pytest.mark.slow
def test_auto_grammar_holds_an_opened_call_to_a_declared_tool(matcher):
    spec = _plan("auto").spec()
    ok, m = matcher(spec, "Sure, here is an answer in prose <tool_call> mentioned in passing? No.")
    assert not ok  # a "<tool_call>" opens a call, whatever follows
    ok, m = matcher(spec, "Plain prose, no call at all.")
    assert ok and m.is_accepting()
    ok, m = matcher(spec, "Checking.\n" + _block("add", {"a": 1, "b": 2}))
    assert ok and m.is_accepting()
    assert not matcher(spec, '<tool_call>\n{"name": "WAYTHEROCOPIA')[0]
    assert not matcher(spec, '<tool_call>\n{"name": "add", "arguments": {"x')[0]
    assert _plan("auto").spec(constrain_auto=False) is None


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True])
def test_required_grammar_ends_after_its_bound(matcher, parallel):
    plan = _plan("required", parallel)
    call = _block("add", {"a": 1, "b": 2})
    ok, m = matcher(plan.spec(), "\n".join([call] * plan.max_calls))
    assert ok and m.is_accepting()
    assert not matcher(plan.spec(), "\n".join([call] * plan.max_calls) + "\n<tool_call>")[0]


# ---- through the server, on the default model -----------------------------------------------------
def _each(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def _ask(client, live_server, prompt, **kw):
    return client.chat.completions.create(model=live_server.model, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_on_ten_prompts(client, live_server, choice, parallel):
    replies = _each(lambda p: _ask(client, live_server, p, tools=TOOLS, tool_choice=choice,
                                   parallel_tool_calls=parallel, max_tokens=GENEROUS), TOOL_PROMPTS)
    for r in replies:
        choice_ = r.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message
        calls = choice_.message.tool_calls
        assert calls and not choice_.message.content
        assert len(calls) == 1 if not parallel else 1 <= len(calls) <= 2
        assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls)  # distinct
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        if isinstance(choice, dict):
            assert {c.function.name for c in calls} == {"get_weather"}
        assert r.usage.completion_tokens < GENEROUS


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_comes_back_parsed(client, live_server):
    """One whole call fits in 50 tokens (~38), the second that parallel calls invite does not."""
    r = _ask(client, live_server, TOOL_PROMPTS[0], tools=TOOLS, tool_choice="required", max_tokens=50)
    assert r.choices[0].finish_reason == "length"
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert "<tool_call>" not in (r.choices[0].message.content or "")


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "Always call a function when one fits."])
def test_auto_never_names_an_undeclared_tool(client, live_server, system):
    def ask(prompt):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return client.chat.completions.create(model=live_server.model, messages=messages, tools=TOOLS,
                                              tool_choice="auto", max_tokens=60, temperature=0)
    for r in _each(ask, TOOL_PROMPTS):
        message = r.choices[0].message
        for c in message.tool_calls or []:
            assert c.function.name in SCHEMAS
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        assert "<tool_call>" not in (message.content or "")
        assert r.choices[0].finish_reason == ("tool_calls" if message.tool_calls else r.choices[0].finish_reason)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_outputs_end_with_stop(client, live_server, kind):
    fmt = ({"type": "json_object"} if kind == "json_object"
           else {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    for r in _each(lambda p: _ask(client, live_server, p, response_format=fmt, max_tokens=GENEROUS_JSON), JSON_PROMPTS):
        assert r.choices[0].finish_reason == "stop", (r.usage.completion_tokens, r.choices[0].message.content)
        value = json.loads(r.choices[0].message.content)
        assert isinstance(value, dict)
        if kind == "json_schema":
            jsonschema.validate(value, CITY)


@pytest.mark.slow
def test_sdk_parse_ends_with_stop(client, live_server):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population: int

    def parse(prompt):
        return client.chat.completions.parse(model=live_server.model, response_format=City, temperature=0,
                                             max_tokens=GENEROUS_JSON, messages=[{"role": "user", "content": prompt}])
    for r in _each(parse, JSON_PROMPTS):  # LengthFinishReasonError would raise here
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, City)


@pytest.mark.slow
def test_auto_with_a_response_format_keeps_that_format(client, live_server):
    """auto's call grammar gives way to the request's own: no 400, the output is its JSON."""
    r = _ask(client, live_server, JSON_PROMPTS[0], tools=TOOLS, tool_choice="auto",
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
             max_tokens=GENEROUS_JSON)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
