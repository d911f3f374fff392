"""The OpenAPI document at ``/openapi.json``, made to say what the server really answers.

FastAPI documents each route with a 200 and its own 422, which kvserve never sends (validation
errors are a 400 in the route's error shape, ``server.errors``), and none of the 400 / 401 / 403 /
404 / 413 / 429 / 503 it does send. ``install_openapi`` post-processes FastAPI's document:

* every route lists the statuses it can answer (``ROUTE_STATUSES``), each error with its body:
  OpenAI's ``{"error": {...}}`` (``OpenAIError``), or Anthropic's ``{"type": "error", ...}``
  (``AnthropicError``) on ``/v1/messages*``; the 422 and its schemas are gone;
* success bodies have a schema (``SUCCESS``): the fields kvserve always sends, extra ones allowed
  (the OpenAI-compatible bodies grow fields without a version bump); the generation routes also
  list ``text/event-stream`` (``stream: true``);
* the API key is a security scheme (``Authorization: Bearer``, and ``x-api-key`` on the
  Messages routes), not a header parameter, and only when the server has a key at all.

``tests/server/test_fuzz_openapi.py`` fuzzes the server against this document with schemathesis.
"""
from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ANTHROPIC_PREFIX = "/v1/messages"  # server.messages.routes.PATH: its errors are Anthropic's shape

_NULLABLE_STR = {"anyOf": [{"type": "string"}, {"type": "null"}]}

ERROR_SCHEMAS: dict[str, dict[str, Any]] = {
    "OpenAIError": {
        "title": "OpenAIError", "type": "object", "required": ["error"],
        "description": "OpenAI's error body (server/errors.py).",
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": _NULLABLE_STR, "code": _NULLABLE_STR}}},
    },
    "AnthropicError": {
        "title": "AnthropicError", "type": "object", "required": ["type", "error"],
        "description": "Anthropic's error body (server/messages/errors.py).",
        "properties": {"type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
    },
}

_INT, _STR, _NUM = {"type": "integer"}, {"type": "string"}, {"type": "number"}


def _obj(required: dict[str, Any], title: str, description: str = "") -> dict[str, Any]:
    """An object schema with these required properties; other properties allowed."""
    schema = {"title": title, "type": "object", "required": list(required), "properties": required}
    if description:
        schema["description"] = description
    return schema


_USAGE = {"type": "object"}
SUCCESS_SCHEMAS: dict[str, dict[str, Any]] = {
    "ChatCompletion": _obj({"id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
                            "choices": {"type": "array", "items": {"type": "object"}}, "usage": _USAGE},
                           "ChatCompletion", "OpenAI's chat.completion; its full schema is OpenAI's "
                           "CreateChatCompletionResponse (tests/server validate against it)."),
    "Completion": _obj({"id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
                        "choices": {"type": "array", "items": {"type": "object"}}, "usage": _USAGE},
                       "Completion", "OpenAI's text_completion."),
    "Response": _obj({"id": _STR, "object": {"const": "response"}, "created_at": _NUM, "status": _STR,
                      "model": _STR, "output": {"type": "array", "items": {"type": "object"}}},
                     "Response", "OpenAI's Responses API response object."),
    "ResponseDeleted": _obj({"id": _STR, "object": {"const": "response"}, "deleted": {"const": True}},
                            "ResponseDeleted"),
    "AnthropicMessage": _obj({"id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"},
                     "content": {"type": "array", "items": {"type": "object"}}, "model": _STR,
                     "stop_reason": _NULLABLE_STR, "usage": _USAGE}, "AnthropicMessage",
                              "Anthropic's Message (the response; the request's turns are Message)."),
    "MessageTokensCount": _obj({"input_tokens": _INT}, "MessageTokensCount"),
    "TokenizeResponse": _obj({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
                              "token_strs": {"anyOf": [{"type": "array", "items": _STR}, {"type": "null"}]}},
                             "TokenizeResponse"),
    "DetokenizeResponse": _obj({"prompt": _STR}, "DetokenizeResponse"),
    "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj(
        {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "max_model_len": _INT},
        "Model")}}, "ModelList"),
    "Health": _obj({"status": {"enum": ["ok", "unavailable"]}}, "Health",
                   "200 ok; 503 unavailable while the engine core is down or reloading."),
    "Version": _obj({"version": _STR}, "Version"),
    "PinList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj(
        {"hash": _STR, "tokens": _INT, "blocks": _INT, "ttl_seconds": _NUM, "ttl_left_seconds": _NUM,
         "salt_id": {}}, "Pin")}, "pinned_blocks": _INT, "max_pinned_blocks": _INT, "created": _INT}, "PinList",
        "The caller's tenant's pinned prefixes (server/cache_routes.py)."),
    "PinDeleted": _obj({"hash": _STR, "object": {"const": "cache.pin"}, "deleted": {"const": True}}, "PinDeleted"),
}

# one server-sent event (schemathesis checks each of a stream's against it): its data is a
# JSON object, or [DONE] at the end of an OpenAI stream
_SSE = {"text/event-stream": {"schema": {
    "title": "ServerSentEvent", "type": "object", "required": ["data"],
    "properties": {"event": _STR, "data": _STR, "id": _STR}}}}

# (method, path) -> (success schema, streams, error statuses). 413: a body over --max-body-bytes
# (server/middleware.py); 401 / 403: no or a wrong key, a tenant without the route's right;
# 429: the queue is full or a tenant limit; 503: the engine core is down (Retry-After).
_GENERATE = (400, 401, 403, 404, 413, 429, 503)
ROUTE_STATUSES: dict[tuple[str, str], tuple[str, bool, tuple[int, ...]]] = {
    ("post", "/v1/chat/completions"): ("ChatCompletion", True, _GENERATE),
    ("post", "/v1/completions"): ("Completion", True, _GENERATE),
    ("post", "/v1/responses"): ("Response", True, _GENERATE),
    ("get", "/v1/responses/{response_id}"): ("Response", False, (401, 403, 404)),
    ("delete", "/v1/responses/{response_id}"): ("ResponseDeleted", False, (401, 403, 404)),
    ("post", "/v1/messages"): ("AnthropicMessage", True, _GENERATE),
    # count_tokens renders the prompt as /v1/messages does (the queue check included), runs nothing
    ("post", "/v1/messages/count_tokens"): ("MessageTokensCount", False, _GENERATE),
    ("post", "/tokenize"): ("TokenizeResponse", False, (400, 401, 403, 404, 413)),
    ("post", "/detokenize"): ("DetokenizeResponse", False, (400, 401, 403, 404, 413)),
    ("get", "/v1/models"): ("ModelList", False, (401, 403)),
    ("get", "/v1/cache"): ("PinList", False, (401, 403, 503)),
    ("delete", "/v1/cache/{block_hash}"): ("PinDeleted", False, (401, 403, 404, 503)),
    ("get", "/health"): ("Health", False, ()),
    ("get", "/version"): ("Version", False, ()),
}
PUBLIC = {"/health", "/version"}  # answered without a key (and /metrics without a key file)

_DESCRIPTIONS = {200: "Success", 400: "Invalid request (a validation error names the parameter)",
                 401: "No or an unknown API key", 403: "The key's tenant lacks this route's right",
                 404: "Unknown model, id or hash (another tenant's included)",
                 413: "Request body too large", 429: "Queue full or a tenant limit hit (Retry-After)",
                 503: "The engine is unavailable (Retry-After)"}
_AUTH_HEADERS = {"authorization", "x-api-key"}


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(node: Any) -> None:
    """pydantic writes a ``Field(ge=...)`` on ``server.protocol.Integer`` (an int behind a
    BeforeValidator) as a raw ``"ge"`` key, which no JSON Schema reader knows: rename them
    (in place) to the keywords they mean; pydantic enforces them all the same."""
    if isinstance(node, list):
        for item in node:
            _json_schema_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for raw, keyword in _BOUNDS.items():
                if raw in node and keyword not in node:
                    node[keyword] = node.pop(raw)
        for value in node.values():
            _json_schema_bounds(value)


def _each(node: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """``node`` and its ``anyOf`` alternatives that have JSON type ``kind``."""
    return [n for n in [node, *node.get("anyOf", [])] if n.get("type") == kind]


def _token_ids(node: Any, vocab_size: int) -> None:
    """Every integer below ``node`` is a token id in [0, vocab_size)."""
    if isinstance(node, list):
        for item in node:
            _token_ids(item, vocab_size)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(minimum=0, maximum=vocab_size - 1)
        for value in node.values():
            _token_ids(value, vocab_size)


def _refine_requests(schemas: dict[str, Any], vocab_size: int | None, max_n: int) -> None:
    """The request rules the server checks itself (after pydantic), written into the document
    so that a schema-valid request is one the server accepts: a conversation needs a turn
    (``messages must contain at least one message``), a prompt a token, a chat turn other than
    the assistant's its content, /tokenize exactly one of ``prompt`` and ``messages``; ``n`` is at
    most ``--max-n`` and token ids are in the vocabulary."""
    def prop(model: str, name: str) -> dict[str, Any]:
        return schemas.get(model, {}).get("properties", {}).get(name, {})

    chat_message = schemas.get("ChatMessage")
    if chat_message is not None:  # server.protocol.ChatMessage._content_required
        chat_message["if"] = {"properties": {"role": {"not": {"const": "assistant"}}}}
        chat_message["then"] = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}
    for model in ("ChatCompletionRequest", "CompletionRequest"):
        for node in _each(prop(model, "n"), "integer"):
            node["maximum"] = min(node.get("maximum", max_n), max_n)
    for model in ("ChatCompletionRequest", "MessagesRequest", "CountTokensRequest"):
        for node in _each(prop(model, "messages"), "array"):
            node["minItems"] = 1
    inputs = prop("ResponsesRequest", "input")
    if inputs.get("type") == "array":  # a string is one user message (server/responses/protocol.py)
        items = {k: inputs.pop(k) for k in ("type", "items") if k in inputs}
        inputs["anyOf"] = [{"type": "string"}, {**items, "minItems": 1}]
    prompt = prop("CompletionRequest", "prompt")
    for node in _each(prompt, "string"):
        node["minLength"] = 1
    for node in _each(prompt, "array"):
        node["minItems"] = 1
        if node.get("items", {}).get("type") == "string":
            node["items"]["minLength"] = 1
        if node.get("items", {}).get("type") == "array":
            node["items"]["minItems"] = 1
    if "TokenizeRequest" in schemas:
        schemas["TokenizeRequest"]["oneOf"] = [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1}}}]
    _refine_anthropic(schemas)
    responses = schemas.get("ResponsesRequest")
    if responses is not None:
        # a field outside server/responses/fields.py's table is a 400 (unknown_parameter); the
        # table's fields the model does not hold: ignored ones take anything, rejected ones are
        # a 400 once they ask for their feature (null never does)
        from server.responses.fields import RESPONSES_EXTRA_FIELDS, RESPONSES_FIELDS
        for rule in (*RESPONSES_FIELDS, *RESPONSES_EXTRA_FIELDS):
            if rule.name not in responses.setdefault("properties", {}):
                responses["properties"][rule.name] = ({"type": "null"} if rule.status == "rejected" else {}) | {
                    "description": f"{rule.status}: {rule.note}"}
        responses["additionalProperties"] = False
    if vocab_size:
        _token_ids(prompt, vocab_size)
        _token_ids(prop("DetokenizeRequest", "tokens"), vocab_size)


# The blocks each role's turn may hold on /v1/messages (server/messages/translate.py: _user,
# _assistant, _system_turn); image and document blocks are refused on every turn (text-only models).
_TURN_BLOCKS = {"user": ("TextBlock", "ToolResultBlock"),
                "assistant": ("TextBlock", "ToolUseBlock", "ThinkingBlock", "RedactedThinkingBlock"),
                "system": ("TextBlock",)}


def _refine_anthropic(schemas: dict[str, Any]) -> None:
    """Anthropic's request rules that the pydantic models leave to the translation: a turn's
    blocks by role, a ``tool`` tool_choice's ``name``, non-empty stop sequences."""
    turn = schemas.get("Message")
    if turn is not None and set(turn.get("properties", {})) == {"role", "content"}:
        blocks = {name: name for names in _TURN_BLOCKS.values() for name in names}
        if all(name in schemas for name in blocks):
            schemas["Message"] = {
                "title": "Message", "description": turn.get("description", ""),
                "oneOf": [{"type": "object", "required": ["role", "content"], "additionalProperties": False,
                           "properties": {"role": {"const": role}, "content": {"anyOf": [
                               {"type": "string"},
                               {"type": "array", "items": {"oneOf": [_ref(name) for name in names]}}]}}}
                          for role, names in _TURN_BLOCKS.items()]}
    choice = schemas.get("ToolChoice")
    if choice is not None and choice.get("properties", {}).get("type", {}).get("enum"):
        choice["if"] = {"properties": {"type": {"const": "tool"}}}
        choice["then"] = {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}
    for model in ("MessagesRequest",):
        for node in _each(schemas.get(model, {}).get("properties", {}).get("stop_sequences", {}), "array"):
            node.setdefault("items", {})["minLength"] = 1


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def document(doc: dict[str, Any], auth_required: bool, vocab_size: int | None = None,
             max_n: int = 128) -> dict[str, Any]:
    """FastAPI's generated document -> kvserve's (a new dict). ``vocab_size``: the token ids the
    model takes (None: not documented); ``max_n``: the server's ``max_n``."""
    doc = copy.deepcopy(doc)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _json_schema_bounds(schemas)
    _refine_requests(schemas, vocab_size, max_n)
    for name, schema in {**ERROR_SCHEMAS, **SUCCESS_SCHEMAS}.items():
        if name in schemas:
            raise RuntimeError(f"schema name {name!r} is taken by a request model")
        schemas[name] = copy.deepcopy(schema)
    if auth_required:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "--api-key, or a key of --api-key-file"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                          "description": "Anthropic's header for the same key (/v1/messages* only)"}}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            # the key is a security scheme, not a parameter (it is read by a dependency)
            params = [p for p in op.get("parameters", []) if not (p.get("in") == "header"
                                                                  and p.get("name", "").lower() in _AUTH_HEADERS)]
            if params:
                op["parameters"] = params
            else:
                op.pop("parameters", None)
            if auth_required and path not in PUBLIC:
                op["security"] = ([{"x-api-key": []}, {"bearer": []}] if path.startswith(ANTHROPIC_PREFIX)
                                  else [{"bearer": []}])
            known = ROUTE_STATUSES.get((method, path))
            op["responses"].pop("422", None)
            if known is None:
                continue
            success, streams, errors = known
            content = {"application/json": {"schema": _ref(success)}}
            if streams:
                content.update(copy.deepcopy(_SSE))
            op["responses"]["200"] = {"description": _DESCRIPTIONS[200], "content": content}
            error = _ref("AnthropicError" if path.startswith(ANTHROPIC_PREFIX) else "OpenAIError")
            for status in errors:
                if status in (401, 403) and not auth_required:
                    continue
                op["responses"][str(status)] = {"description": _DESCRIPTIONS[status],
                                                "content": {"application/json": {"schema": dict(error)}}}
            if path == "/health":
                op["responses"]["503"] = {"description": _DESCRIPTIONS[503],
                                          "content": {"application/json": {"schema": _ref("Health")}}}
    if not any("HTTPValidationError" in str(ops) for ops in doc.get("paths", {}).values()):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return doc


def vocab_size(serving: Any) -> int | None:
    """The token ids both the tokenizer (/detokenize) and the engine (prompts) take, if known."""
    sizes = [len(serving.tokenizer)] if serving.tokenizer is not None else []
    info_size = getattr(getattr(serving.engine, "info", None), "vocab_size", None)
    if isinstance(info_size, int):
        sizes.append(info_size)
    return min(sizes) if sizes else None


def install_openapi(app: FastAPI, serving: Any) -> None:
    """Serve ``document(...)`` of ``app``'s routes at /openapi.json (built once, on first use)
    for ``serving`` (an OpenAIServing: whether a key is needed, the vocabulary)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(get_openapi(title=app.title, version=app.version, routes=app.routes,
                                                      openapi_version=app.openapi_version),
                                          auth_required=not serving.tenancy.registry.open,
                                          vocab_size=vocab_size(serving), max_n=serving.config.max_n)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
