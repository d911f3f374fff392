"""A Messages request as the ``ChatCompletionRequest`` that runs it.

Anthropic's shapes map onto chat completions' without loss for what kvserve serves: ``system``
becomes the first (system) message, and a mid-conversation ``system`` turn a system message in
its place; a user turn's ``tool_result`` blocks become ``tool``
messages in their place; an assistant turn's ``tool_use`` blocks become its ``tool_calls``;
``tools`` become function tools (``input_schema`` as ``parameters``; server tools and
``defer_loading`` ones are left out); ``tool_choice`` ``any``
is ``required`` and ``tool`` a named function; ``stop_sequences`` is ``stop``. Cache
breakpoints keep their place: a text block's ``cache_control`` stays on its part, one on a
``tool_use`` / ``tool_result`` block or on a tool covers its whole message (the tools are
rendered into the system message), and the request-level one is a breakpoint after the last
message (Anthropic's automatic caching).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from server.errors import bad_request
from server.messages.protocol import (CountTokensRequest, CustomTool, MediaBlock, MessagesRequest,
                                      RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from server.protocol import ChatCompletionRequest


@dataclass
class Translation:
    chat: ChatCompletionRequest
    dropped_tools: list[str] = field(default_factory=list)  # server and deferred tools, not offered to the model


def _cache(block: Any) -> dict[str, Any] | None:
    return block.cache_control.model_dump() if block.cache_control is not None else None


def _text_parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    """Text blocks as chat text parts; each block but the last ends with the blank line that
    ``join_text`` puts between blocks, so that a breakpoint on a part pins what the model sees."""
    parts = []
    for i, b in enumerate(blocks):
        part: dict[str, Any] = {"type": "text", "text": b.text + ("\n\n" if i < len(blocks) - 1 else "")}
        if b.cache_control is not None:
            part["cache_control"] = _cache(b)
        parts.append(part)
    return parts


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    return [{"role": "system", "content": _text_parts(system)}] if system else []


def _user(index: int, content: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _text_parts(texts)})
            texts.clear()

    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            flush()
            text = block.text()
            message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id,
                                       "content": f"Error: {text}" if block.is_error else text}
            if block.cache_control is not None:
                message["cache_control"] = _cache(block)
            out.append(message)
        else:
            raise bad_request(f"a user message cannot hold a '{block.type}' block", f"messages.{index}.content.{j}")
    flush()
    return out


def _assistant(index: int, content: list[Any]) -> dict[str, Any]:
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    cache: dict[str, Any] | None = None
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            cache = _cache(block) or cache
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            continue
        else:
            raise bad_request(f"an assistant message cannot hold a '{block.type}' block",
                              f"messages.{index}.content.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if cache is not None:
        message["cache_control"] = cache
    return message


def _system_turn(index: int, content: list[Any]) -> dict[str, Any]:
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise bad_request(f"a system message cannot hold a '{block.type}' block", f"messages.{index}.content.{j}")
    return {"role": "system", "content": _text_parts(content)}


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out = _system(body.system)
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            for j, block in enumerate(m.content):
                if isinstance(block, MediaBlock):
                    raise bad_request(f"'{block.type}' blocks are not supported: kvserve serves text-only models",
                                      f"messages.{i}.content.{j}")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            out.append(_system_turn(i, m.content))
        elif m.role == "user":
            out.extend(_user(i, m.content))
        else:
            out.append(_assistant(i, m.content))
    return out


def _tools(body: CountTokensRequest) -> tuple[list[dict[str, Any]], list[str], dict[str, Any] | None]:
    """(function tools, the server and deferred tools left out, the longest-lived breakpoint on a tool)."""
    tools, dropped, cache = [], [], None
    for t in body.tools or []:
        if not isinstance(t, CustomTool):
            dropped.append(f"{t.name} ({t.type})")
            continue
        if t.defer_loading:
            dropped.append(f"{t.name} (defer_loading)")
            continue
        function: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            function["description"] = t.description
        tools.append({"type": "function", "function": function})
        if t.cache_control is not None and (cache is None or t.cache_control.ttl == "1h"):
            cache = _cache(t)
    return tools, dropped, cache


def _tool_choice(body: CountTokensRequest, tools: list[dict[str, Any]]) -> tuple[Any, bool]:
    choice = body.tool_choice
    if choice is None:
        return (None, True)
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.type in ("auto", "none") and not tools:
        return None, parallel  # Anthropic accepts a choice over no (custom) tools
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def translate(body: CountTokensRequest, max_stop: int) -> Translation:
    """The chat request that runs ``body`` (a ``MessagesRequest``, or a ``CountTokensRequest``,
    which runs as one with ``max_tokens`` 1); 400 naming the Messages field on bad input."""
    messages = _messages(body)
    if not body.messages or not messages:  # all turns empty: a top-level cache_control has nothing to mark
        raise bad_request("messages must contain at least one message", "messages")
    tools, dropped, tool_cache = _tools(body)
    tool_choice, parallel = _tool_choice(body, tools)
    if body.cache_control is not None:
        messages[-1]["cache_control"] = body.cache_control.model_dump()
    if tools and tool_choice != "none" and tool_cache is not None:
        # The tools are rendered into the system message, so its breakpoint covers them; without a
        # system message an empty one carries the breakpoint (it merges into the tool listing).
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0].setdefault("cache_control", tool_cache)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "parallel_tool_calls": parallel}
    if tools:
        chat["tools"] = tools
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if isinstance(body, MessagesRequest):
        stops = body.stop_sequences or []
        if len(stops) > max_stop:
            raise bad_request(f"at most {max_stop} stop sequences are allowed, got {len(stops)}", "stop_sequences")
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        if stops:
            chat["stop"] = stops
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        thinking = body.thinking
        if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is not None:
            chat["thinking_token_budget"] = thinking.budget_tokens  # the engine closes the block there
    else:
        chat["max_tokens"] = 1
    try:
        return Translation(ChatCompletionRequest.model_validate(chat), dropped)
    except ValidationError as exc:  # a value the chat request refuses (e.g. a tool name)
        first = exc.errors()[0]
        raise bad_request(f"invalid request: {first.get('msg', 'invalid')}", None) from None
