"""A Responses request as the ``ChatCompletionRequest`` that runs it.

Items become chat messages: ``instructions`` a system message first; a ``function_call`` joins
the assistant turn before it as a tool call (or starts one); a ``function_call_output`` is a
``tool`` message; ``reasoning`` items are left out. Tools are flattened (``namespace`` entries
into their function tools) and hosted tools dropped, named in ``Translation.dropped``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from server.errors import bad_request
from server.protocol import ChatCompletionRequest
from server.responses.protocol import (DroppedTool, FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                                       MessageItem, NamespaceTool, ResponsesRequest)


@dataclass
class Translation:
    chat: ChatCompletionRequest
    tools: list[FunctionTool]  # the function tools offered to the model (echoed in the response)
    dropped: list[str]  # hosted tool types not offered, in request order, each once


def flatten_tools(entries: list[Any] | None) -> tuple[list[FunctionTool], list[str]]:
    functions: list[FunctionTool] = []
    dropped: dict[str, None] = {}
    for entry in entries or []:
        for tool in entry.tools if isinstance(entry, NamespaceTool) else [entry]:
            if isinstance(tool, DroppedTool):
                dropped[tool.type] = None
            else:
                functions.append(tool)
    return functions, list(dropped)


def to_messages(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a 'schema'", "text.format.schema")
    schema = {"name": fmt.name or "response", "schema": fmt.json_schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def _reasoning_budget(reasoning: dict[str, Any] | None) -> int | None:
    """``reasoning.max_tokens`` (OpenRouter's shape; OpenAI's ``reasoning`` has none): the think block's cap."""
    value = (reasoning or {}).get("max_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"reasoning.max_tokens must be an integer >= 0, got {value!r}", "reasoning.max_tokens")
    return value


def translate(body: ResponsesRequest, history: list[Any]) -> Translation:
    """``body`` (after ``history``, the stored conversation it continues) as a chat request."""
    functions, dropped = flatten_tools(body.tools)
    messages = to_messages(body.instructions, [*history, *body.items()])
    if not messages:
        raise bad_request("input must contain at least one item", "input")
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if functions:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in functions]
    if body.tool_choice is not None and (functions or body.tool_choice == "none"):
        choice = body.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    elif body.tool_choice not in (None, "auto") and not functions:
        raise bad_request("tool_choice needs function tools", "tool_choice")
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    for ours, theirs in (("max_completion_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("prompt_cache_key", "prompt_cache_key"),
                         ("prompt_cache_retention", "prompt_cache_retention"), ("priority", "priority")):
        value = getattr(body, theirs)
        if value is not None:
            chat[ours] = value
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    budget = _reasoning_budget(body.reasoning)
    if budget is not None:
        chat["thinking_token_budget"] = budget
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # our items were valid; this is a rule only chat has
        first = exc.errors()[0]
        raise bad_request(f"invalid request: {first.get('msg')}", "input") from None
    return Translation(request, functions, dropped)
