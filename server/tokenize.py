"""``/tokenize`` and ``/detokenize`` in vLLM's shape (its clients and load generators call them).

``POST /tokenize`` takes either ``prompt`` (text; ``add_special_tokens`` defaults to true) or
``messages`` (rendered with the chat template; ``add_generation_prompt`` defaults to true) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only when
``return_token_strs`` is true). ``POST /detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.tokenizer import TemplateError, encode_chat
from server.errors import bad_request
from server.protocol import ChatMessage
from server.tools import render_messages


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenize(serving: Any, body: TokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    tokenizer = serving.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer(body.prompt, add_special_tokens=add_special)["input_ids"])
    else:
        try:
            ids = encode_chat(tokenizer, render_messages(body.messages or [], None, False),
                              add_generation_prompt=body.add_generation_prompt)
        except TemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def detokenize(serving: Any, body: DetokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        serving.check_model(body.model)
    vocab = len(serving.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab})", "tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}
