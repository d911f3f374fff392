"""Where a ``cache_control`` breakpoint pins (server/cache_routes.py), when the rendered messages are
not the request's one for one: with tools and a template without a tools section, the tool listing
is a system message put first, and a breakpoint on request message i must still pin the prompt up to
the end of message i (rendered message i + 1)."""
from __future__ import annotations

import pytest

from engine.tokenizer import encode_chat
from server.cache_routes import chat_cache_policy
from server.protocol import ChatCompletionRequest
from server.tools import plan_tools, render_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    assert "tools" not in tok.chat_template  # the listing is kvserve's own system message
    return tok


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _pinned(tokenizer, messages: list[dict], tools: list | None) -> tuple[int, list[dict], list[int]]:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    rendered = render_messages(body.messages, plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls),
                               False)
    prompt = encode_chat(tokenizer, rendered)
    return chat_cache_policy(body, tokenizer, rendered, prompt, False).pin_tokens, rendered, prompt


@pytest.mark.parametrize("part", [False, True])
def test_a_breakpoint_pins_up_to_its_own_message_when_the_tool_listing_comes_first(tokenizer, part):
    first = ({"role": "user", "content": [{"type": "text", "text": "a long question", "cache_control": EPHEMERAL}]}
             if part else {"role": "user", "content": "a long question", "cache_control": EPHEMERAL})
    messages = [first, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    pinned, rendered, prompt = _pinned(tokenizer, messages, [WEATHER])
    assert len(rendered) == 4 and rendered[0]["role"] == "system"  # the listing, put first
    upto_user = _shared(encode_chat(tokenizer, rendered[:2], add_generation_prompt=False), prompt)
    upto_listing = _shared(encode_chat(tokenizer, rendered[:1], add_generation_prompt=False), prompt)
    assert pinned == upto_user > upto_listing


def test_without_tools_the_indices_agree(tokenizer):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "a long question", "cache_control": EPHEMERAL},
                {"role": "user", "content": "more"}]
    pinned, rendered, prompt = _pinned(tokenizer, messages, None)
    assert pinned == _shared(encode_chat(tokenizer, rendered[:2], add_generation_prompt=False), prompt)
