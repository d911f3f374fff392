"""The bounds that make JSON grammars end (engine.sampling.json_bounds), without the model."""
from __future__ import annotations

import json

import jsonschema

from engine.sampling.json_bounds import JSON_OBJECT_SCHEMA, MAX_STRING_CHARS, SAFE_INTEGER, bounded
from engine.sampling.structured_output import grammar_definition, validate_spec
from kvtypes.structured_spec import StructuredOutputSpec


def test_unbounded_integers_get_the_json_safe_range_and_nothing_else_changes():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "m": {"type": "integer", "minimum": 0},
        "x": {"type": "number"}, "s": {"type": "string"}, "e": {"enum": [{"type": "integer"}]},
        "l": {"type": "array", "items": {"type": ["integer", "null"]}}}}
    out = bounded(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["m"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert props["x"] == schema["properties"]["x"] and props["s"] == schema["properties"]["s"]
    assert props["e"] == schema["properties"]["e"]  # enum values are data, not schemas
    assert props["l"]["items"]["maximum"] == SAFE_INTEGER
    assert schema["properties"]["n"] == {"type": "integer"}  # a copy


def test_json_object_is_a_bounded_object_that_compiles():
    doc = {"name": "Paris", "tags": ["a", 1, None], "info": {"x": 1.5, "y": True}}
    jsonschema.validate(doc, JSON_OBJECT_SCHEMA)
    for too_much in ({"s": "a" * (MAX_STRING_CHARS + 1)}, {"a": {"b": {"c": 1}}}, {"l": list(range(7))},
                     {str(i): i for i in range(7)}):
        try:
            jsonschema.validate(too_much, JSON_OBJECT_SCHEMA)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"{too_much} should be out of bounds")
    spec = StructuredOutputSpec("json_object")
    validate_spec(spec)
    schema = json.loads(grammar_definition(spec))["grammars"][0]["json_schema"]
    assert schema["patternProperties"] and schema["x-guidance"]["whitespace_flexible"] is False
