"""How one request's output reasons, as the engine needs it: a small, picklable spec.

The frontend knows whether the model marks thinking with ``<think>`` / ``</think>`` and whether
the prompt opened the block (``server/reasoning.py``); it sends that, with the tags' token ids and
an optional budget, inside ``SamplingParams`` to the engine, which runs one
``engine.sampling.reasoning.ReasoningState`` per request from it: a budget forces the closing
tag after ``budget`` tokens inside the block, and a grammar starts only once the block is closed.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSpec:
    """``start_token_ids`` / ``end_token_ids``: the tags as the tokenizer encodes them (one token each
    for R1 distills and Qwen3); ``starts_inside``: the prompt ends inside an open block;
    ``budget``: at most this many tokens inside the block (None: no cap)."""

    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    starts_inside: bool = False
    budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("start_token_ids", "end_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{name} must be a non-empty tuple of token ids")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {self.budget!r}")
