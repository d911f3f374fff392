"""Streaming under load and with multi-byte text; prefix-cache accounting in usage."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.server.conftest import parse_sse

pytestmark = pytest.mark.slow


def test_multibyte_stream_never_splits_a_character(client, http, live_server):
    tokenizer = live_server.engine.tokenizer
    kwargs = dict(model=live_server.model, prompt="Emoji party: 🎉🎉😀😃🎉", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    # The test means something only if the output has characters spread over several tokens.
    assert any(ord(ch) > 0x7F for ch in full), full
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no multi-token character in the output"

    with http.stream("POST", "/v1/completions", json={**kwargs, "stream": True}) as r:
        raw = b"".join(r.iter_bytes())
    chunks = parse_sse(raw.decode("utf-8"))  # strict UTF-8: a split character would not decode
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == full
    assert sum(1 for p in pieces if p) >= 2  # really streamed, not one blob

    chat_kwargs = dict(model=live_server.model, max_tokens=12, temperature=0,
                       messages=[{"role": "user", "content": "Write a greeting in Japanese."}])
    chat_full = client.chat.completions.create(**chat_kwargs).choices[0].message.content
    assert any(ord(ch) > 0x7F for ch in chat_full), chat_full
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat_kwargs)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == chat_full


PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer:" if i % 2 else
           f"Write one sentence about the number {i}." for i in range(32)]


def test_32_concurrent_streams_match_greedy(make_async_client, live_server, openai_schemas):
    def messages(i):
        return [{"role": "user", "content": PROMPTS[i]}]

    async def full(ac, i):
        r = await ac.chat.completions.create(model=live_server.model, messages=messages(i), max_tokens=12,
                                             temperature=0)
        return r.choices[0].message.content

    async def streamed(ac, i):
        stream = await ac.chat.completions.create(model=live_server.model, messages=messages(i), max_tokens=12,
                                                  temperature=0, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            openai_schemas.validate("CreateChatCompletionStreamResponse", chunk.model_dump(mode="json",
                                                                                          exclude_unset=True))
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def main():
        async with make_async_client() as ac:
            expected = await asyncio.gather(*(full(ac, i) for i in range(32)))
            got = await asyncio.gather(*(streamed(ac, i) for i in range(32)))
        return expected, got

    expected, got = asyncio.run(main())
    assert all(finish in ("stop", "length") for _, finish in got)
    mismatches = [(i, expected[i], got[i][0]) for i in range(32) if got[i][0] != expected[i]]
    assert not mismatches, mismatches
    assert len(set(expected)) > 8  # different prompts, different answers
    assert live_server.wait_idle()


SYSTEM = ("You are a meticulous librarian. " + " ".join(
    f"Rule {i}: always cite the shelf number, the author and the year of every book you mention." for i in range(40)))


def test_shared_system_prompt_reports_cached_tokens(client, live_server):
    tokenizer = live_server.engine.tokenizer
    assert len(tokenizer(SYSTEM)["input_ids"]) > 550

    def ask(question, salt=None):
        extra = {"cache_salt": salt} if salt else None
        r = client.chat.completions.create(model=live_server.model, max_tokens=2, temperature=0, extra_body=extra,
                                           messages=[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": question}])
        return r.usage

    ask("Which book is on shelf 3?")
    second = ask("Who wrote the oldest book?")
    cached = second.prompt_tokens_details.cached_tokens
    assert 550 < cached < second.prompt_tokens
    assert cached % live_server.engine.info.block_size == 0
    # Another tenant (cache_salt) shares nothing, even with the identical prompt.
    other = ask("Who wrote the oldest book?", f"tenant-{uuid.uuid4().hex}")
    assert other.prompt_tokens_details.cached_tokens == 0
