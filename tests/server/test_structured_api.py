"""Structured outputs, logit_bias, echo+logprobs, /tokenize and the no-silent-ignoring table,
through the openai SDK and plain HTTP against the real server on the default model."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server.openai_fields import TABLES, markdown_table

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


# ---- the SDK's parse() over ten schemas ------------------------------------------------------
class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str
    country: str


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str
    city: City


class Employee(BaseModel):
    person: Person
    address: Address


class Palette(BaseModel):
    colors: list[Color] = Field(min_length=1, max_length=3)


class Score(BaseModel):
    score: float = Field(ge=0, le=10)
    passed: bool


class Tags(BaseModel):
    title: str
    tags: list[str] = Field(max_length=3)


class Sentiment(BaseModel):
    sentiment: Color
    confidence: int = Field(ge=1, le=5)


class Point(BaseModel):
    x: int = Field(ge=-10, le=10)
    y: int = Field(ge=-10, le=10)


class Recipe(BaseModel):
    dish: str
    servings: int = Field(ge=1, le=8)
    vegetarian: bool


class Flight(BaseModel):
    origin: City
    destination: City
    stops: int = Field(ge=0, le=3)


PARSE_CASES = [
    ("Give a famous city.", City), ("Describe a person.", Person), ("Describe an employee.", Employee),
    ("Pick some colors.", Palette), ("Grade this essay: 'Cats are nice.'", Score),
    ("Tag a blog post about Python.", Tags), ("How does 'I love it' feel?", Sentiment),
    ("Give a point on a grid.", Point), ("Suggest a recipe.", Recipe), ("Plan a flight.", Flight),
]


def test_sdk_parse_ten_schemas(client, live_server):
    """client.chat.completions.parse(response_format=<pydantic model>) returns a parsed object
    (or, when max_tokens cut the JSON, says so with finish_reason length)."""
    def run(case):
        prompt, model = case
        return model, client.chat.completions.parse(
            model=live_server.model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format=model, max_tokens=96, temperature=0)

    with ThreadPoolExecutor(len(PARSE_CASES)) as pool:  # one batch, not ten sequential runs
        results = list(pool.map(run, PARSE_CASES))
    parsed = 0
    for model, r in results:
        choice = r.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, model), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
        parsed += 1
    assert parsed >= 8, [r.choices[0].message.content for _, r in results]


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}


def test_streamed_json_schema_validates(client, live_server, openai_schemas):
    stream = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
        max_tokens=120, temperature=0.7, seed=5, stream=True)
    chunks = list(stream)
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", c.model_dump(mode="json", exclude_unset=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_length_cut(client, live_server):
    r = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Give me a JSON object about dogs."}],
        response_format={"type": "json_object"}, max_tokens=64, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    cut = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        max_tokens=4, temperature=0)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content.startswith("{")


def test_bad_schema_is_a_400(live_server):
    r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={
        "model": live_server.model, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert live_server.async_engine.is_healthy


def test_guided_choice_extra(live_server):
    r = httpx.post(f"{live_server.v1}/completions", headers=live_server.headers, timeout=60, json={
        "model": live_server.model, "prompt": "Is the sky blue? Answer:", "max_tokens": 5,
        "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")


# ---- logit_bias ---------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans(client, live_server, temperature):
    tok = live_server.engine.tokenizer
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=live_server.model, prompt="The capital of France is", max_tokens=4,
                                  temperature=temperature, logit_bias={str(forced): 100}, seed=1)
    assert r.choices[0].text == tok.decode([forced] * 4)
    base = client.completions.create(model=live_server.model, prompt="The capital of France is", max_tokens=1,
                                     temperature=0)
    banned = tok.encode(base.choices[0].text, add_special_tokens=False)[0]
    for seed in range(3):
        r = client.completions.create(model=live_server.model, prompt="The capital of France is", max_tokens=1,
                                      temperature=temperature, logit_bias={str(banned): -100}, seed=seed,
                                      logprobs=1)
        assert r.choices[0].text != base.choices[0].text


@pytest.mark.parametrize("bias", [{"49152": 1}, {"-1": 1}, {"5": 100.5}, {"5": -101}, {"abc": 1}])
def test_logit_bias_out_of_range_is_a_400(live_server, bias):
    r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json={
        "model": live_server.model, "messages": [{"role": "user", "content": "x"}], "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias"


# ---- echo + prompt logprobs ---------------------------------------------------------------------
def test_echo_logprobs_match_transformers(client, live_server, hf_default_model):
    import torch

    prompt = "The quick brown fox jumps over the lazy dog."
    ids = live_server.engine.tokenizer(prompt)["input_ids"]
    for stream in (False, True):
        kwargs = dict(model=live_server.model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True)
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            lp = chunks[0].choices[0].logprobs
        else:
            r = client.completions.create(**kwargs)
            text, lp = r.choices[0].text, r.choices[0].logprobs
        assert text.startswith(prompt)
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) >= len(ids)
        with torch.no_grad():
            ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
        got = lp.token_logprobs[1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, expected)) < 0.05, (got, expected)
        assert all(len(t) >= 1 for t in lp.top_logprobs[1:len(ids)])


# ---- /tokenize, /detokenize ---------------------------------------------------------------------
def test_tokenize_and_detokenize(live_server):
    h = live_server.headers
    r = httpx.post(f"{live_server.base_url}/tokenize", headers=h, json={"model": live_server.model,
                                                                        "prompt": "hello world"}).json()
    assert r["tokens"] == live_server.engine.tokenizer("hello world")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == live_server.engine.max_model_len
    back = httpx.post(f"{live_server.base_url}/detokenize", headers=h, json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    chat = httpx.post(f"{live_server.base_url}/tokenize", headers=h, json={
        "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}).json()
    assert chat["count"] == len(chat["tokens"]) == len(chat["token_strs"]) > 3
    bad = httpx.post(f"{live_server.base_url}/detokenize", headers=h, json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- every rejected field of the table gets its 400 ---------------------------------------------
REJECTED = [(kind, rule) for kind, rules in TABLES.items() for rule in rules if rule.status == "rejected"]


@pytest.mark.parametrize("kind,rule", REJECTED, ids=[f"{k}-{r.name}" for k, r in REJECTED])
def test_rejected_fields_get_a_400(live_server, kind, rule):
    body = {"model": live_server.model, rule.name: rule.example, "max_tokens": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    path = "chat/completions" if kind == "chat" else "completions"
    r = httpx.post(f"{live_server.v1}/{path}", headers=live_server.headers, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == rule.name


def test_ignored_and_unknown_fields_are_accepted(live_server):
    body = {"model": live_server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "modalities": ["text"], "store": False, "metadata": {"a": "b"}, "reasoning_effort": "low",
            "top_k": 5, "ignore_eos": True, "some_vllm_extra": 1}
    r = httpx.post(f"{live_server.v1}/chat/completions", headers=live_server.headers, json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_table_covers_every_openai_field_and_the_docs(openai_schemas):
    def props(name):
        schema, out = openai_schemas.schemas[name], set()
        for part in schema.get("allOf", [schema]):
            out |= props(part["$ref"].split("/")[-1]) if "$ref" in part else set(part.get("properties", {}))
        return out

    for kind, schema in (("chat", "CreateChatCompletionRequest"), ("completions", "CreateCompletionRequest")):
        assert {r.name for r in TABLES[kind]} == props(schema), kind
    docs = (REPO / "docs" / "api.md").read_text()
    for kind in TABLES:
        assert markdown_table(kind) in docs, f"docs/api.md's {kind} table is stale: regenerate it"
