"""The SSE frames of one streamed completion: ``data: <chunk JSON>\\n\\n``.

Contract: every frame is byte for byte ``"data: " + json.dumps(chunk, ensure_ascii=False) +
"\\n\\n"`` of the chunk dict ``{"id", "object", "created", "model", "choices"[, "usage"]}`` (the
OpenAI conformance tests hold these bytes). A stream sends one frame per token, so the parts
that never change (id, object, created, model, and ``"usage": null`` when usage is on) are
encoded once, and a choice of plain text with no logprobs, the common frame, is written from a
template around its one JSON string instead of through ``json.dumps`` of nested dicts.
"""
from __future__ import annotations

import json
import time
from json.encoder import encode_basestring  # what json.dumps(str, ensure_ascii=False) writes
from typing import Any


# json.dumps(value, ensure_ascii=False), the same text, without the new JSONEncoder that
# json.dumps builds for every call with a non-default argument (~0.7 us of a ~3 us call); every
# SSE event of the chat-shaped APIs goes through it
json_text = json.JSONEncoder(ensure_ascii=False).encode


def _reason(finish_reason: str | None) -> str:
    return "null" if finish_reason is None else encode_basestring(finish_reason)


class ChunkWriter:
    """Frames of one stream; with ``usage_on`` (``stream_options.include_usage``) every chunk
    carries ``usage``, null until the last."""

    def __init__(self, request_id: str, object_name: str, model: str, usage_on: bool) -> None:
        created = int(time.time())
        self._head = (f'data: {{"id": {json_text(request_id)}, "object": {json_text(object_name)}, '
                      f'"created": {created}, "model": {json_text(model)}, "choices": ')
        self._usage_on = usage_on
        self._tail = ', "usage": null}\n\n' if usage_on else "}\n\n"

    def __call__(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        """The frame of ``choices`` (each a dict, as the chunk's JSON has it) and ``usage``."""
        tail = f', "usage": {json_text(usage)}}}\n\n' if usage is not None and self._usage_on else self._tail
        return self._head + json_text(choices) + tail

    def delta(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None) -> str:
        """A chat chunk of one choice: ``{"index", "delta", "logprobs", "finish_reason"}``."""
        if logprobs is None and len(delta) == 1 and type(delta.get("content")) is str:
            return (f'{self._head}[{{"index": {index}, "delta": {{"content": {encode_basestring(delta["content"])}}}, '
                    f'"logprobs": null, "finish_reason": {_reason(finish_reason)}}}]{self._tail}')
        return self([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def text(self, index: int, text: str, logprobs: Any = None, finish_reason: str | None = None) -> str:
        """A completions chunk of one choice: ``{"index", "text", "logprobs", "finish_reason"}``."""
        if logprobs is None:
            return (f'{self._head}[{{"index": {index}, "text": {encode_basestring(text)}, "logprobs": null, '
                    f'"finish_reason": {_reason(finish_reason)}}}]{self._tail}')
        return self([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
