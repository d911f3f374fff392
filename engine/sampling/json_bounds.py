"""Bounds that make a JSON grammar end: what a schema leaves unbounded, a small model loops on.

Measured on SmolLM2-135M: an unbounded integer becomes ``1111111...`` until ``max_tokens``;
``json_object`` (any object) becomes a string that repeats itself, an array that never closes,
or an object nested in itself. Once the top-level value closes the grammar is complete and the
engine stops the request (no EOS step needed), so bounding each value is enough to end it.

- every schema: an ``integer`` without a ``minimum`` / ``maximum`` gets the JSON-safe range
  (``±(2**53 - 1)``, the integers every JSON parser reads exactly);
- ``json_object``: the object is :data:`JSON_OBJECT_SCHEMA`, at most two levels deep, with at
  most :data:`MAX_PROPERTIES` keys of 1 to :data:`MAX_KEY_CHARS` characters, arrays of at
  most :data:`MAX_ITEMS` items and strings of at most :data:`MAX_STRING_CHARS` characters.

A ``json_schema`` keeps its own strings and arrays as written (a client that wants bounds
writes ``maxLength`` / ``maxItems``); numbers with a fraction are not bounded (a schema cannot
bound their digits).
"""
from __future__ import annotations

from typing import Any

SAFE_INTEGER = 2**53 - 1
MAX_STRING_CHARS = 64
MAX_KEY_CHARS = 32
MAX_ITEMS = 6
MAX_PROPERTIES = 6


def _json_object_schema() -> dict[str, Any]:
    scalar = {"anyOf": [{"type": "string", "maxLength": MAX_STRING_CHARS},
                        {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER},
                        {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
    key = f"^.{{1,{MAX_KEY_CHARS}}}$"  # llguidance has no propertyNames; a key pattern does it

    def obj(values: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "patternProperties": {key: values}, "additionalProperties": False,
                "maxProperties": MAX_PROPERTIES}

    inner = {"anyOf": [scalar, {"type": "array", "items": scalar, "maxItems": MAX_ITEMS}, obj(scalar)]}
    return obj(inner)


JSON_OBJECT_SCHEMA: dict[str, Any] = _json_object_schema()


def bounded(schema: Any) -> Any:
    """``schema`` with every unbounded ``integer`` held to the JSON-safe range (a copy)."""
    if isinstance(schema, list):
        return [bounded(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else bounded(v)) for k, v in schema.items()}
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types and "number" not in types):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out
