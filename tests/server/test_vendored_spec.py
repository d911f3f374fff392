"""The vendored cut of OpenAI's spec is complete: every root is there and every $ref resolves."""
from __future__ import annotations

import json

from tests.assets.openai_spec.extract_schemas import ROOTS, refs
from tests.server.conftest import OPENAI_SCHEMAS


def test_vendored_schemas_are_closed_under_ref_and_name_their_source():
    doc = json.loads(OPENAI_SCHEMAS.read_text(encoding="utf-8"))
    schemas = doc["components"]["schemas"]
    assert set(ROOTS) <= set(schemas)
    dangling = {name for schema in schemas.values() for name in refs(schema)} - set(schemas)
    assert not dangling, f"refs to schemas missing from the vendored file: {sorted(dangling)}"
    source = doc["source"]
    assert source["repository"] == "openai/openai-openapi" and len(source["commit"]) == 40
    assert (OPENAI_SCHEMAS.parent / "LICENSE").read_text().startswith("The MIT License")


def test_the_validator_rejects_a_malformed_response(openai_schemas):
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert openai_schemas.errors("ErrorResponse", good) == []
    assert openai_schemas.errors("ErrorResponse", {"error": {"message": 3}})
