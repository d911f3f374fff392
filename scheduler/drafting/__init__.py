"""Draft-free drafters for speculative decoding: one interface (``Drafter``), one registry
(``DRAFTERS``, keyed by ``speculative_config.method``), one module per method: ``ngram.py``
(prompt lookup), ``suffix.py`` (suffix decoding over the request and recent requests' outputs).

A drafter only proposes: it never sees logits, and what it proposes changes how many tokens a
verify step yields, never which (engine/sampling/verification.py decides acceptance).
"""
from __future__ import annotations

from scheduler.drafting.base import Drafter
from scheduler.drafting.ngram import NgramDrafter
from scheduler.drafting.suffix import SuffixDrafter

DRAFTERS: dict[str, type[Drafter]] = {"ngram": NgramDrafter, "suffix": SuffixDrafter}

__all__ = ["DRAFTERS", "Drafter", "NgramDrafter", "SuffixDrafter", "build_drafter"]


def build_drafter(config) -> Drafter:
    """The drafter of ``config.method`` (a ``SpeculativeConfig``, which validated the method)."""
    return DRAFTERS[config.method](config)
