"""Compatibility alias: the grammar spec value lives in :mod:`kvtypes.structured_spec`."""
from kvtypes.structured_spec import JSON_LAYOUT, KINDS, SpecKind, StructuredOutputSpec

__all__ = ["JSON_LAYOUT", "KINDS", "SpecKind", "StructuredOutputSpec"]
