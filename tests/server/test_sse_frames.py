"""``server.sse.ChunkWriter``: every frame is byte for byte the ``json.dumps`` of the chunk dict
(the frame the serving code wrote before the template fast path), for the template's cases
(plain text, finish reasons, non-ASCII, quotes, control characters, surrogates) and the others
(logprobs, tool-call and reasoning deltas, usage), with usage on and off."""
from __future__ import annotations

import json

import pytest

from server.sse import ChunkWriter

TEXTS = ["", " hello", 'a "quoted" \\ back', "line\nbreak\ttab\x00\x1f", "héllo wörld 日本語 🙂", "\ud800 lone"]
REQUEST_ID, MODEL = 'chatcmpl-"odd" id', "SmolLM2 é"


def reference(writer_created: int, object_name: str, choices, usage_on: bool, usage=None) -> str:
    data = {"id": REQUEST_ID, "object": object_name, "created": writer_created, "model": MODEL, "choices": choices}
    if usage_on:
        data["usage"] = usage
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def created_of(frame: str) -> int:
    return json.loads(frame[len("data: "):])["created"]


@pytest.mark.parametrize("usage_on", [False, True])
@pytest.mark.parametrize("finish_reason", [None, "stop", "length", "tool_calls"])
def test_frames_equal_json_dumps_of_the_chunk(usage_on, finish_reason):
    chat = ChunkWriter(REQUEST_ID, "chat.completion.chunk", MODEL, usage_on)
    completion = ChunkWriter(REQUEST_ID, "text_completion", MODEL, usage_on)
    logprobs = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}
    deltas = [{"content": t} for t in TEXTS] + [
        {"role": "assistant", "content": ""}, {"reasoning_content": "why", "reasoning": "why"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}, {}]
    for delta in deltas:
        for lp in (None, logprobs):
            got = chat.delta(3, delta, lp, finish_reason)
            want = reference(created_of(got), "chat.completion.chunk",
                             [{"index": 3, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}], usage_on)
            assert got == want, (delta, lp)
    for text in TEXTS:
        for lp in (None, {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [None], "text_offset": [0]}):
            got = completion.text(0, text, lp, finish_reason)
            want = reference(created_of(got), "text_completion",
                             [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}], usage_on)
            assert got == want, (text, lp)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}}
    got = chat([], usage)
    assert got == reference(created_of(got), "chat.completion.chunk", [], usage_on, usage)
