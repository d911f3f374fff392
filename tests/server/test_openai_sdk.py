"""The official ``openai`` SDK against a live kvserve: chat, completions, streaming, params, typed errors.

Every response and chunk is also validated against OpenAI's published OpenAPI schemas.
"""
from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colors of the rainbow."}]


def dump(obj) -> dict:
    """The JSON the server sent (exclude_unset: SDK defaults are not the wire format)."""
    return obj.model_dump(mode="json", exclude_unset=True)


def test_sync_chat(client, live_server, openai_schemas):
    r = client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=8, temperature=0)
    openai_schemas.validate("CreateChatCompletionResponse", dump(r))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == live_server.model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 8


def test_async_chat_matches_sync(client, make_async_client, live_server, openai_schemas):
    kwargs = dict(model=live_server.model, messages=CHAT, max_tokens=8, temperature=0)

    async def main():
        async with make_async_client() as ac:
            return await ac.chat.completions.create(**kwargs)

    r = asyncio.run(main())
    openai_schemas.validate("CreateChatCompletionResponse", dump(r))
    assert r.choices[0].message.content == client.chat.completions.create(**kwargs).choices[0].message.content


def test_streaming_chat_equals_non_streamed(client, live_server, openai_schemas):
    kwargs = dict(model=live_server.model, messages=CHAT, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", dump(c))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0] is chunks[-1]
    assert finishing[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage


def test_stream_include_usage(client, live_server, openai_schemas):
    kwargs = dict(model=live_server.model, messages=CHAT, max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", dump(c))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content


def test_completions_string_list_and_token_ids(client, live_server, openai_schemas):
    prompts = ["The capital of France is", "One, two, three,"]
    kwargs = dict(model=live_server.model, max_tokens=6, temperature=0)
    singles = []
    for p in prompts:
        r = client.completions.create(prompt=p, **kwargs)
        openai_schemas.validate("CreateCompletionResponse", dump(r))
        assert r.id.startswith("cmpl-") and r.object == "text_completion"
        assert len(r.choices) == 1 and r.choices[0].text and r.choices[0].logprobs is None
        singles.append(r)

    both = client.completions.create(prompt=prompts, **kwargs)
    openai_schemas.validate("CreateCompletionResponse", dump(both))
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    ids = live_server.engine.tokenizer(prompts[0], add_special_tokens=True)["input_ids"]
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert by_ids.choices[0].text == singles[0].choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == singles[0].usage.prompt_tokens
    two_id_lists = client.completions.create(prompt=[ids, ids], **kwargs)
    assert [c.text for c in two_id_lists.choices] == [singles[0].choices[0].text] * 2


def test_n_2(client, live_server, openai_schemas):
    r = client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=6, n=2,
                                       temperature=1.0, seed=7)
    openai_schemas.validate("CreateChatCompletionResponse", dump(r))
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content is not None for c in r.choices)
    from engine.tokenizer import encode_chat

    assert r.usage.prompt_tokens == len(encode_chat(live_server.engine.tokenizer, CHAT))  # counted once
    assert 2 <= r.usage.completion_tokens <= 12  # summed over both choices

    chunks = list(client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=4, n=2,
                                                  temperature=0, stream=True))
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", dump(c))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices are the same text


def _stop_spanning_tokens(tokenizer, text: str) -> str:
    """A substring of ``text`` that starts inside one token and ends inside the next-but-one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    for k in range(1, len(pieces) - 2):
        a, b, c = pieces[k], pieces[k + 1], pieces[k + 2]
        if len(a) >= 2 and len(c) >= 2 and b and text.find(a[-1] + b + c[0]) == sum(map(len, pieces[:k])) + len(a) - 1:
            return a[-1] + b + c[0]
    raise AssertionError(f"no token-spanning stop string found in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens(client, live_server, stream):
    prompt = "Here is a short story about a cat named Tom. Tom"
    kwargs = dict(model=live_server.model, prompt=prompt, max_tokens=16, temperature=0)
    base = client.completions.create(**kwargs).choices[0].text
    stop = _stop_spanning_tokens(live_server.engine.tokenizer, base)
    expected = base[:base.index(stop)]
    if stream:
        chunks = list(client.completions.create(stop=[stop, "zzzz-never"], stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert all(stop not in c.choices[0].text for c in chunks)
    else:
        r = client.completions.create(stop=stop, **kwargs)
        text, finish = r.choices[0].text, [r.choices[0].finish_reason]
    assert stop not in text
    assert text == expected
    assert finish == ["stop"]


def test_chat_logprobs(client, live_server, openai_schemas):
    r = client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    openai_schemas.validate("CreateChatCompletionResponse", dump(r))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # greedy: the sampled token is the best alternative
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert "".join(e.token for e in content) == r.choices[0].message.content

    chunks = list(client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=5,
                                                  temperature=0, logprobs=True, top_logprobs=2, stream=True))
    for c in chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", dump(c))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)

    plain = client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, live_server, openai_schemas):
    r = client.completions.create(model=live_server.model, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=2)
    openai_schemas.validate("CreateCompletionResponse", dump(r))
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    offset = 0
    for token, logprob, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert start == offset
        offset += len(token)
        assert 1 <= len(top) <= 2
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert max(values) == pytest.approx(logprob, abs=1e-4) and token in top


def test_models_list(client, live_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [live_server.model]
    assert models.data[0].object == "model" and models.data[0].owned_by


def test_typed_errors(client, live_server, openai_schemas):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found"
    openai_schemas.validate("ErrorResponse", exc.value.response.json())

    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=2, temperature=3.5)
    assert exc.value.status_code == 400 and exc.value.param == "temperature"
    openai_schemas.validate("ErrorResponse", exc.value.response.json())

    max_len = live_server.engine.max_model_len
    long_prompt = "hello " * (max_len + 50)
    n_prompt = len(live_server.engine.tokenizer(long_prompt)["input_ids"])
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=live_server.model, prompt=long_prompt, max_tokens=2)
    assert exc.value.code == "context_length_exceeded"
    assert str(max_len) in exc.value.message and str(n_prompt) in exc.value.message
    openai_schemas.validate("ErrorResponse", exc.value.response.json())

    with pytest.raises(openai.BadRequestError) as exc:  # fits alone, not with max_tokens
        client.completions.create(model=live_server.model, prompt="hello there", max_tokens=max_len)
    n_prompt = len(live_server.engine.tokenizer("hello there")["input_ids"])
    assert exc.value.code == "context_length_exceeded"
    assert str(max_len) in exc.value.message and str(n_prompt + max_len) in exc.value.message

    with openai.OpenAI(base_url=live_server.v1, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as exc:
            bad.chat.completions.create(model=live_server.model, messages=CHAT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert exc.value.status_code == 401
    openai_schemas.validate("ErrorResponse", exc.value.response.json())
