"""Response objects and their output items (``reasoning``, ``message``, ``function_call``), streamed or whole.

``OutputBuilder`` turns a choice's chat deltas (what ``ToolStreamer`` makes of the text, and the
``reasoning_content`` that ``server.reasoning`` splits off before it) into
output items and, when streaming, into the typed SSE events that build them; the whole
(non-streamed) response goes through the same builder in one step, so both agree.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

from server.responses.protocol import FunctionCallItem, MessageItem, ResponsesRequest, TextPart


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(chat_usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    """A chat ``usage`` (server.runs.usage) in the Responses shape; ``reasoning_tokens``: the
    output tokens of the think block (its tags included)."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": chat_usage["prompt_tokens_details"]["cache_write_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(response_id: str, created_at: int, model: str, body: ResponsesRequest,
                    tools: list[Any], status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Response, echoing the request's settings as OpenAI does."""
    choice = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type != "text":
        text_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            text_format.update(name=fmt.name or "response", schema=fmt.json_schema, strict=fmt.strict,
                               description=fmt.description)
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "model": model, "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": ("auto" if choice is None else choice if isinstance(choice, str)
                        else {"type": "function", "name": choice.name}),
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict} for t in tools],
        "text": {"format": text_format},
        "truncation": "disabled",
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "metadata": dict(body.metadata or {}),
        "reasoning": {"effort": None, "summary": None},
        "usage": usage,
    }


def as_input_items(output: list[dict[str, Any]]) -> list[Any]:
    """Output items as the input items that continue the conversation (for the store)."""
    items: list[Any] = []
    for item in output:
        if item["type"] == "message":
            items.append(MessageItem(role="assistant", content=[TextPart(type="output_text", text=part["text"])
                                                                for part in item["content"]]))
        elif item["type"] == "function_call":
            items.append(FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                          arguments=item["arguments"]))
    return items


class OutputBuilder:
    """The output items of one choice, fed its chat deltas (``{"content"}`` / ``{"tool_calls"}``).

    Each method returns the SSE events of what it did (``(type, payload)`` pairs); the caller
    numbers and frames them, or drops them for a non-streamed response.
    """

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item

    def feed(self, delta: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        if delta.get("reasoning_content"):
            yield from self._think(delta["reasoning_content"])
        if delta.get("content") or delta.get("tool_calls"):
            yield from self._close_reasoning()
        if delta.get("content"):
            yield from self._close_call()
            yield from self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            yield from self._close_message()
            function = call.get("function", {})
            if call.get("id") is not None:
                yield from self._close_call()
                yield from self._open_call(call["id"], function.get("name", ""))
            if function.get("arguments") and self._call is not None:
                self._call["arguments"] += function["arguments"]
                yield "response.function_call_arguments.delta", {
                    "item_id": self._call["id"], "output_index": self._index(self._call),
                    "delta": function["arguments"]}

    def finish(self, incomplete: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        """Close what is open; an output with no item gets an empty message. The last item of
        an incomplete response is ``incomplete``."""
        if all(item["type"] == "reasoning" for item in self.output):
            yield from self._close_reasoning()
            yield from self._text("")
        last = self.output[-1]
        if incomplete:
            last["status"] = "incomplete"
        yield from self._close_reasoning()
        yield from self._close_message()
        yield from self._close_call()

    # ---- items --------------------------------------------------------------------------------
    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _think(self, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Reasoning text, into the reasoning item (opened at its first text, before any message)."""
        if self._reasoning is None:
            self._reasoning = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                               "status": "in_progress"}
            self.output.append(self._reasoning)
            index = len(self.output) - 1
            yield "response.output_item.added", {"output_index": index, "item": _copy(self._reasoning)}
            self._reasoning["content"].append({"type": "reasoning_text", "text": ""})
            yield "response.content_part.added", {"item_id": self._reasoning["id"], "output_index": index,
                                                  "content_index": 0, "part": _copy(self._reasoning["content"][0])}
        self._reasoning["content"][0]["text"] += text
        yield "response.reasoning_text.delta", {"item_id": self._reasoning["id"],
                                                "output_index": self._index(self._reasoning), "content_index": 0,
                                                "delta": text}

    def _close_reasoning(self) -> Iterator[tuple[str, dict[str, Any]]]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return
        index, part = self._index(item), item["content"][0]
        if item["status"] == "in_progress":
            item["status"] = "completed"
        yield "response.reasoning_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                               "text": part["text"]}
        yield "response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                             "part": _copy(part)}
        yield "response.output_item.done", {"output_index": index, "item": _copy(item)}

    def _text(self, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if self._message is None:
            self._message = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": []}
            self.output.append(self._message)
            index = len(self.output) - 1
            yield "response.output_item.added", {"output_index": index, "item": _copy(self._message)}
            self._message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            yield "response.content_part.added", {"item_id": self._message["id"], "output_index": index,
                                                  "content_index": 0, "part": _copy(self._message["content"][0])}
        if text:
            self._message["content"][0]["text"] += text
            yield "response.output_text.delta", {"item_id": self._message["id"], "output_index":
                                                 self._index(self._message), "content_index": 0, "delta": text,
                                                 "logprobs": []}

    def _close_message(self) -> Iterator[tuple[str, dict[str, Any]]]:
        item, self._message = self._message, None
        if item is None:
            return
        index, part = self._index(item), item["content"][0]
        if item["status"] == "in_progress":
            item["status"] = "completed"
        yield "response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                            "text": part["text"], "logprobs": []}
        yield "response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                             "part": _copy(part)}
        yield "response.output_item.done", {"output_index": index, "item": _copy(item)}

    def _open_call(self, call_id: str, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
        self._call = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                      "name": name, "arguments": ""}
        self.output.append(self._call)
        yield "response.output_item.added", {"output_index": len(self.output) - 1, "item": _copy(self._call)}

    def _close_call(self) -> Iterator[tuple[str, dict[str, Any]]]:
        item, self._call = self._call, None
        if item is None:
            return
        index = self._index(item)
        if item["status"] == "in_progress":
            item["status"] = "completed"
        yield "response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                        "name": item["name"], "arguments": item["arguments"]}
        yield "response.output_item.done", {"output_index": index, "item": _copy(item)}


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))
