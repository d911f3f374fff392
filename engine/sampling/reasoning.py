"""One request's think block, followed token by token: the reasoning budget and the grammar's start.

A request whose ``SamplingParams.reasoning`` is set and that has a budget or a grammar gets one
``ReasoningState`` (``LLMEngine.add_request``); every other request has none and pays nothing.
The sampler asks it two things each step (``forced_token``, ``grammar_active``) and the engine
feeds it each sampled token (``accept``), so its state is exact whatever path computed the logits
(the native decode kernel, CUDA graphs or the layer-by-layer forward) and wherever the engine
runs (in the server's process or the core process; the spec travels in ``SamplingParams``).

Phases (vLLM's semantics for both features):

- ``before``: the prompt left no block open. The first token may open one (when ``<think>`` is
  one token, it is allowed in addition to whatever the grammar allows); any other first token
  starts the answer.
- ``thinking``: inside the block; the grammar waits. After ``budget`` tokens inside it the
  closing tag is forced, one token per step (``closing`` while a several-token tag is written),
  and the output goes on normally after it. A model that writes the tag itself (as the tokenizer
  encodes it) closes the block earlier.
- ``answer``: after the block (or without one); the grammar, if any, holds every token from here.
"""
from __future__ import annotations

from collections import deque

from kvtypes.reasoning_spec import ReasoningSpec

BEFORE, THINKING, CLOSING, ANSWER = "before", "thinking", "closing", "answer"


class ReasoningState:
    """Where one request's output is against its think block; only the engine thread uses it."""

    def __init__(self, spec: ReasoningSpec) -> None:
        self.spec = spec
        self.phase = THINKING if spec.starts_inside else BEFORE
        self.num_reasoning_tokens = 0  # tokens inside the block, the closing tag excluded
        self._closing = 0  # tokens of the closing tag written so far, while forcing it
        self._tail: deque[int] = deque(maxlen=len(spec.end_token_ids))

    @property
    def grammar_active(self) -> bool:
        """The request's grammar holds the next token (it waits while the block is open)."""
        return self.phase in (BEFORE, ANSWER)

    @property
    def open_token(self) -> int | None:
        """A token allowed next besides the grammar's: ``<think>`` at the output's start (one-token tags)."""
        if self.phase == BEFORE and len(self.spec.start_token_ids) == 1:
            return self.spec.start_token_ids[0]
        return None

    def forced_token(self) -> int | None:
        """The token the next step must produce (the closing tag, once the budget is spent), or None."""
        if self.phase == CLOSING:
            return self.spec.end_token_ids[self._closing]
        budget = self.spec.budget
        if self.phase == THINKING and budget is not None and self.num_reasoning_tokens >= budget:
            return self.spec.end_token_ids[0]
        return None

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; True when it belongs to the answer (the grammar consumes it)."""
        if self.phase == ANSWER:
            return True
        if self.phase == BEFORE:
            if self.open_token == token:
                self.phase = THINKING
                return False
            self.phase = ANSWER
            return True
        end = self.spec.end_token_ids
        if self.phase == THINKING and self.forced_token() is not None:  # this token was forced: end[0]
            self._closing = 0
            self.phase = CLOSING
        if self.phase == CLOSING:
            self._closing += 1
            if self._closing == len(end):
                self.phase = ANSWER
            return False
        self._tail.append(token)
        if len(self._tail) == len(end) and tuple(self._tail) == end:
            self.phase = ANSWER
        else:
            self.num_reasoning_tokens += 1
        return False


def needs_state(spec: ReasoningSpec | None, has_grammar: bool) -> bool:
    """Whether a request needs a ``ReasoningState``: a budget to enforce or a grammar to hold back."""
    return spec is not None and (spec.budget is not None or has_grammar)
