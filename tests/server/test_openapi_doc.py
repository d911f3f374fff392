"""/openapi.json (server/openapi.py) without a model: the statuses, bodies and auth it states.

tests/server/test_fuzz_openapi.py checks the document against the running server."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from server.openapi import ROUTE_STATUSES


def openapi(**config) -> dict:
    engine = SimpleNamespace(model_name="m", tokenizer=None, is_healthy=True, error=None, max_model_len=8)
    r = TestClient(build_app(engine, ServerConfig(**config))).get("/openapi.json")  # no lifespan: no engine
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def doc() -> dict:
    return openapi(api_key="secret")


def test_every_route_states_its_real_statuses_and_no_422(doc):
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == set(ROUTE_STATUSES), "a route without an entry in server/openapi.py's table"
    for (method, path), (_, _, errors) in ROUTE_STATUSES.items():
        responses = doc["paths"][path][method]["responses"]
        assert "422" not in responses
        assert set(responses) == {"200", *map(str, errors)} | ({"503"} if path == "/health" else set())
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_errors_have_their_routes_shape(doc):
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for status, response in op["responses"].items():
                if status.startswith("4"):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    want = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
                    assert ref.endswith("/" + want), (path, status)


def test_the_key_is_a_security_scheme_not_a_parameter(doc):
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert not any(p["in"] == "header" for p in op.get("parameters", [])), path
            if path in ("/health", "/version"):
                assert "security" not in op
            else:
                assert op["security"][-1] == {"bearer": []}, path


def test_without_a_key_no_auth_is_documented():
    doc = openapi()
    assert "securitySchemes" not in doc["components"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "security" not in chat and "401" not in chat["responses"] and "400" in chat["responses"]


def test_pydantic_bounds_are_json_schema_keywords(doc):
    """server.protocol.Integer's Field(ge=...) came out as a raw "ge" key; now "minimum"."""
    schemas = doc["components"]["schemas"]
    top = schemas["ChatCompletionRequest"]["properties"]["top_logprobs"]["anyOf"][0]
    assert top["minimum"] == 0 and top["maximum"] == 20 and "ge" not in top
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == ServerConfig().max_n
    numbers = [node for node in _dicts(schemas) if node.get("type") in ("integer", "number")]
    assert not [node for node in numbers if {"ge", "le", "gt", "lt"} & set(node)]


def _dicts(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _dicts(value)
