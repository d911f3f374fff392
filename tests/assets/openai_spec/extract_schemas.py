"""Cut the schemas kvserve's tests validate against out of OpenAI's published OpenAPI spec.

The tests must not read anything outside the repository, so the part of the spec they use is
vendored here as ``schemas.json``: the named root schemas and every schema they reach through
``$ref``, unchanged, plus where they came from. Regenerate after updating the spec:

    python tests/assets/openai_spec/extract_schemas.py path/to/openapi.yaml \\
        --commit <openai/openai-openapi commit of that file>

The spec is OpenAI's, under the MIT license (``LICENSE`` beside this file).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

import yaml

HERE = Path(__file__).resolve().parent
OUT = HERE / "schemas.json"
SOURCE_REPO = "openai/openai-openapi"

# What the tests validate: response bodies, stream chunks and errors, and the two request
# bodies whose fields docs/api.md classifies (supported / ignored / rejected).
ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "ErrorResponse",
)
PREFIX = "#/components/schemas/"


def refs(node: Any) -> Iterator[str]:
    """Every schema name that ``node`` refers to with ``$ref``."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            yield ref[len(PREFIX):]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def closure(schemas: dict[str, Any], roots: tuple[str, ...]) -> dict[str, Any]:
    """The roots and everything reachable from them, in name order (a stable file)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in schemas:
            raise KeyError(f"schema {name!r} is referenced but not defined in the spec")
        seen.add(name)
        todo.extend(refs(schemas[name]))
    return {name: schemas[name] for name in sorted(seen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="OpenAI's openapi.yaml")
    parser.add_argument("--commit", required=True, help=f"the {SOURCE_REPO} commit the spec file comes from")
    args = parser.parse_args()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc = yaml.load(args.spec.read_text(encoding="utf-8"), Loader=loader)
    out = {
        "source": {"repository": SOURCE_REPO, "path": "openapi.yaml", "commit": args.commit,
                   "spec_version": doc["info"]["version"], "license": "MIT (see LICENSE)", "roots": list(ROOTS)},
        "components": {"schemas": closure(doc["components"]["schemas"], ROOTS)},
    }
    OUT.write_text(json.dumps(out, indent=1, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(out['components']['schemas'])} schemas)")


if __name__ == "__main__":
    main()
