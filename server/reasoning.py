"""Reasoning output: the text a thinking model writes between ``<think>`` and ``</think>``.

One splitter for every endpoint (chat completions' ``reasoning_content``, Responses' reasoning
items, Messages' ``thinking`` blocks): ``ReasoningParser`` takes the output's text deltas and
gives (reasoning, content) deltas, holding back any text that may be the start of a tag split
across deltas, so no tag character ever reaches either side.

When a model reasons is decided from its tokenizer (``think_tags``): the tags appear in its chat
template (DeepSeek-R1 distills, Qwen3) or ``</think>`` is one of its added tokens. A model
without them gets no parser, and its output is exactly what it was.

The grammar of the output: optional whitespace, then a ``<think>`` block, then the content. A
prompt that already ends with ``<think>`` (R1's template opens the block for the model) starts
the output inside the block; a grammar of the request then starts after ``</think>`` (the engine
holds it back, ``engine/sampling/reasoning.py``), so a structured request keeps its thinking. Text that
does not begin with ``<think>`` is all content; an unclosed block (cut by ``max_tokens``) is all
reasoning. The whitespace right after ``</think>`` is dropped, so the content starts with its
first word.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtypes.reasoning_spec import ReasoningSpec

OPEN = "<think>"
CLOSE = "</think>"


def think_tags(tokenizer: Any) -> bool:
    """Whether this model marks thinking with ``<think>`` tags (see the module doc)."""
    if tokenizer is None:
        return False
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(str(t) for t in template.values())
    if OPEN in template or CLOSE in template:
        return True
    try:
        added = tokenizer.get_added_vocab()
    except (AttributeError, NotImplementedError):
        return False
    return CLOSE in added


def think_token_ids(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The tags as the tokenizer encodes them (start, end), or None when it cannot encode them."""
    try:
        start, end = (tuple(tokenizer.encode(tag, add_special_tokens=False)) for tag in (OPEN, CLOSE))
    except (AttributeError, TypeError, ValueError):
        return None
    return (start, end) if start and end else None


@dataclass(frozen=True)
class ThinkMode:
    """How one request's output reasons: ``starts_inside`` when its prompt opened the block."""

    starts_inside: bool = False

    @classmethod
    def for_prompt(cls, tokenizer: Any, prompt_ids: list[int]) -> "ThinkMode":
        tail = tokenizer.decode(prompt_ids[-8:]) if prompt_ids else ""
        return cls(starts_inside=tail.rstrip().endswith(OPEN))

    def parser(self) -> "ReasoningParser":
        return ReasoningParser(self.starts_inside)

    def spec(self, tag_ids: tuple[tuple[int, ...], tuple[int, ...]], budget: int | None) -> ReasoningSpec:
        """What the engine needs to cap the block at ``budget`` tokens and start a grammar after it."""
        return ReasoningSpec(tag_ids[0], tag_ids[1], self.starts_inside, budget)


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits one output, fed as text deltas, into reasoning and content.

    ``feed`` returns the (reasoning, content) text that is certain so far; ``finish`` what was
    held back. ``opened`` says whether a think block was seen (so the output has reasoning,
    maybe empty); ``reasoning_tokens`` counts the output tokens up to and including the closing
    tag (all of them while the block is open), given the running token count to ``feed``.
    """

    def __init__(self, starts_inside: bool = False) -> None:
        self._state = "reasoning" if starts_inside else "start"  # start | reasoning | after | content
        self._held = ""
        self.opened = starts_inside
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning, content = [], []
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self.opened, buf = "reasoning", True, stripped[len(OPEN):]
                elif OPEN.startswith(stripped):  # whitespace, or the tag's beginning: wait
                    self._held, buf = buf, ""
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = buf.find(CLOSE)
                if end >= 0:
                    reasoning.append(buf[:end])
                    self._state, buf = "after", buf[end + len(CLOSE):]
                    self.reasoning_tokens = num_tokens
                else:
                    keep = _partial(buf, CLOSE)
                    reasoning.append(buf[:len(buf) - keep])
                    self._held, buf = buf[len(buf) - keep:], ""
            elif self._state == "after":
                stripped = buf.lstrip()
                self._state, buf = ("content", stripped) if stripped else ("after", "")
            else:
                content.append(buf)
                buf = ""
        if self._state == "reasoning":
            self.reasoning_tokens = num_tokens
        return "".join(reasoning), "".join(content)

    def step(self, out: Any) -> tuple[str, str]:
        """One engine output's (reasoning, content) text (``out``: a ``RequestOutput``); the last
        output also gives what was held back."""
        reasoning, content = self.feed(out.text, out.num_output_tokens)
        if out.finished:
            r, c = self.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back: a cut tag's beginning is reasoning inside the block, content before it."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def split(text: str, mode: ThinkMode) -> tuple[str | None, str]:
    """A whole output as (its reasoning, None when no block was opened; its content)."""
    parser = mode.parser()
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2 if parser.opened else None), c1 + c2
