"""Running a Messages request: the chat pipeline's run, formatted as Anthropic's ``message`` or SSE events.

Usage is counted as Anthropic counts it, the three input counts disjoint: ``cache_read_input_tokens``
are the prompt tokens served from the prefix cache, ``cache_creation_input_tokens`` those this
request wrote into retained cache (a ``cache_control`` pin) beyond what it read, and
``input_tokens`` the rest; the three add up to the prompt (what ``count_tokens`` answers).

A reasoning model's think block (split off by ``server.reasoning``) is a ``thinking`` block first,
with an empty ``signature``, when the request asks for ``thinking`` (``enabled`` / ``adaptive``);
otherwise it is left out of the output, as Anthropic shows no thinking unasked. With
``thinking.display: omitted`` the block is still there, its text empty.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtypes.outputs import RequestOutput
from server.errors import APIError
from server.messages.errors import sse_error_event
from server.middleware import header_value
from server.messages.protocol import CountTokensRequest, MessagesRequest
from server.messages.translate import translate
from server.reasoning import split
from server.runs import ChatRun, Choice, EngineRequestError, cancel_on_disconnect
from server.serving import OpenAIServing
from server.sse import json_text
from server.tools import ToolPlan, ToolStreamer, finish_message

logger = logging.getLogger(__name__)

DROPPED_TOOLS_HEADER = "x-kvserve-dropped-tools"


def usage(choice: Choice) -> dict[str, int]:
    prompt = choice.num_prompt_tokens
    read = min(choice.num_cached_tokens, prompt)
    written = max(0, min(choice.num_cache_write_tokens, prompt) - read)
    return {"input_tokens": prompt - read - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read, "output_tokens": choice.num_output_tokens}


def stop_reason(finish_reason: str | None, stopped_on: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice (its chat finish_reason after tool parsing)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stopped_on, str) and stopped_on in stop_sequences:
        return "stop_sequence", stopped_on
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def shows_thinking(body: MessagesRequest) -> bool:
    return body.thinking is not None and body.thinking.type in ("enabled", "adaptive")


def omits_thinking(body: MessagesRequest) -> bool:
    """``thinking.display: omitted``: the thinking block comes back with empty text (its signature kept)."""
    return body.thinking is not None and body.thinking.display == "omitted"


def content_blocks(message: dict[str, Any], thinking: str | None = None,
                   omitted: bool = False) -> list[dict[str, Any]]:
    """A chat ``message`` (content, tool_calls) as Messages content blocks, after its ``thinking``
    (``omitted``: the block is there, its text empty)."""
    blocks: list[dict[str, Any]] = []
    if thinking:
        blocks.append({"type": "thinking", "thinking": "" if omitted else thinking, "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def _event(type_: str, data: dict[str, Any]) -> str:
    return f"event: {type_}\ndata: {json_text({'type': type_, **data})}\n\n"


class BlockWriter:
    """Chat deltas (``content`` / ``tool_calls``, from a ToolStreamer; ``thinking``, the reasoning
    text) as content-block events: a thinking block, then a text block while text comes, a new
    ``tool_use`` block at each call's first delta. ``omit_thinking``: the thinking block is
    started and stopped with no ``thinking_delta`` (``thinking.display: omitted``)."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.omit_thinking = omit_thinking

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("thinking"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                events.append(_event("content_block_delta", {"index": self.index,
                                                             "delta": {"type": "thinking_delta",
                                                                       "thinking": delta["thinking"]}}))
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(_event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "text_delta", "text": delta["content"]}}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                       "name": call["function"]["name"], "input": {}})
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                events.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": arguments}}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


class MessagesServing:
    """``/v1/messages`` and its ``count_tokens`` on an ``OpenAIServing`` (its checks, tokenizer, engine)."""

    def __init__(self, chat: OpenAIServing) -> None:
        self.chat = chat

    async def _prepare(self, body: CountTokensRequest, admit: bool = True) -> tuple[ChatRun, dict[str, str]]:
        translation = translate(body, self.chat.config.max_stop)
        headers = {}
        if translation.dropped_tools:
            names = ", ".join(translation.dropped_tools)
            logger.info("/v1/messages: tools not offered to the model (server tools kvserve cannot run, deferred "
                        "tools no tool search loads): %s", names)
            headers[DROPPED_TOOLS_HEADER] = header_value(names)  # the names are the client's
        run = await self.chat.prepare_chat(translation.chat, "msg", clamp_max_tokens=True, admit=admit)
        return run, headers

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        run, _ = await self._prepare(body, admit=False)
        return {"input_tokens": len(run.jobs[0].prompt_token_ids)}

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        run, headers = await self._prepare(body)
        message_id = "msg_" + run.request_id.split("-", 1)[1]
        if body.stream:
            return self.chat.pushed(run.jobs, None, MessageFrames(self, message_id, run, body), headers)
        response = await cancel_on_disconnect(raw, self._full(message_id, run, body))
        response.headers.update(headers)
        return response

    def _message(self, message_id: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 choice: Choice) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(choice)}

    async def _full(self, message_id: str, run: ChatRun, body: MessagesRequest) -> Response:
        stopped_on = None
        try:
            async for _, out in self.chat.stream_outputs(run.jobs, None):
                if out.finished:
                    stopped_on = out.stop_reason
        except EngineRequestError as exc:
            raise APIError(exc.status, str(exc), exc.type, None, exc.code) from None
        choice = run.jobs[0].choice
        thinking, text = split(choice.text, run.think) if run.think is not None else (None, choice.text)
        message, finish_reason = finish_message(run.plan, text, choice.finish_reason)
        reason, sequence = stop_reason(finish_reason, stopped_on, body.stop_sequences or [])
        blocks = content_blocks(message, thinking if shows_thinking(body) else None, omits_thinking(body))
        return JSONResponse(self._message(message_id, blocks, reason, sequence, choice))



class MessageFrames:
    """A streamed message's events (``server.stream_frames.Frames``), as Anthropic sends them:
    ``message_start`` (after the prefill, when the cache counts are known) and a ``ping``, the
    content blocks' start / delta / stop events as thinking, text and tool calls come, then
    ``message_delta`` (stop reason, usage) and ``message_stop``; an engine error is an ``error``
    event, the last."""

    def __init__(self, serving: MessagesServing, message_id: str, run: ChatRun, body: MessagesRequest) -> None:
        self.serving, self.message_id, self.body = serving, message_id, body
        self.streamer = ToolStreamer(run.plan or ToolPlan("none", []))
        self.blocks = BlockWriter(omits_thinking(body))
        self.parser = run.think.parser() if run.think is not None else None
        self.show = shows_thinking(body)
        self.started = False

    def opening(self) -> list[str]:
        return []

    def output(self, choice: Choice, out: RequestOutput) -> list[str]:
        frames = []
        if not self.started:  # after the prefill: the cache counts are known
            self.started = True
            frames += [_event("message_start", {"message": self.serving._message(self.message_id, [], None, None,
                                                                                 choice)}),
                       _event("ping", {})]
        thinking, text = self.parser.step(out) if self.parser is not None else ("", out.text)
        if thinking and self.show:
            frames += self.blocks.feed({"thinking": thinking})
        frames += self.blocks.feed(self.streamer.delta(text))
        if out.finished:
            tail, finish_reason = self.streamer.final(choice.finish_reason)
            frames += self.blocks.feed(tail) + self.blocks.close()
            reason, sequence = stop_reason(finish_reason, out.stop_reason, self.body.stop_sequences or [])
            frames += [_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                "usage": usage(choice)}),
                       _event("message_stop", {})]
        return frames

    def closing(self) -> list[str]:
        return []

    def error(self, exc: EngineRequestError) -> list[str]:
        return [sse_error_event(exc.status, str(exc))]
