"""What a request asks its output to look like: a small, picklable grammar spec.

The frontend turns ``response_format`` / ``tools`` / vLLM's ``guided_*`` extras into one
:class:`StructuredOutputSpec`; it travels inside ``SamplingParams`` to the engine, which
compiles it (see ``engine.sampling.structured_output``). No dependency beyond the standard library,
so the spec can cross a process boundary and be imported anywhere (it lives in kvtypes;
``kvtypes.structured_spec`` re-exports it).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

SpecKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")

# JSON is generated compactly, with exactly one space after ':' and ',' and none elsewhere:
# a grammar that allows free whitespace lets a small model loop on spaces or newlines
# until max_tokens. These are llguidance's JSON compile options (its "x-guidance" key).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class StructuredOutputSpec:
    """``kind`` says how to read ``value``:

    - ``json_schema``: a JSON Schema, as JSON text;
    - ``json_object``: any JSON object (``value`` is ignored, conventionally ``""``);
    - ``regex``: a regular expression the whole output must match;
    - ``grammar``: a Lark (or GBNF) grammar;
    - ``choice``: a JSON list of strings, the output being exactly one of them.
    """

    kind: SpecKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError("a structured output spec's value must be a string")

    @property
    def key(self) -> str:
        """Stable hash of the spec (the compiled-grammar cache key, with the tokenizer's)."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()

    @staticmethod
    def json_schema(schema: dict) -> "StructuredOutputSpec":
        # Key order kept: JSON Schema property order is the order the model is asked to write.
        return StructuredOutputSpec("json_schema", json.dumps(schema, separators=(",", ":")))
