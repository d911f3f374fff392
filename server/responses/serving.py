"""``POST /v1/responses``: a Responses request run as a chat request, its result as a Response
object or as typed SSE events; ``GET`` and ``DELETE`` on the stored ones.

The engine work is the chat path's: ``OpenAIServing.prepare_chat`` (validation, template,
tokenizing, tool plan, jobs), then ``OpenAIServing.stream_outputs`` (the outputs as they come)
or, streamed, ``OpenAIServing.pushed`` with ``ResponseFrames``. A streamed response's last event
carries the same Response the non-streamed call returns.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtypes.outputs import RequestOutput
from server.tenants import current_tenant
from server.errors import APIError
from server.middleware import header_value
from server.responses.output import OutputBuilder, as_input_items, new_id, response_object, response_usage
from server.responses.protocol import ResponsesRequest
from server.responses.store import ResponseStore
from server.responses.translate import Translation, translate
from server.reasoning import ReasoningParser
from server.runs import ChatRun, Choice, EngineRequestError, cancel_on_disconnect, prompt_lengths, usage
from server.serving import OpenAIServing
from server.sse import json_text
from server.tools import ToolPlan, ToolStreamer, finish_message

logger = logging.getLogger(__name__)

DROPPED_TOOLS_HEADER = "x-kvserve-dropped-tools"
# A chat error's param, renamed to the Responses field it came from.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id '{response_id}' not found (unknown, deleted, or evicted from the "
                         "store).", "invalid_request_error", param,
                    "previous_response_not_found" if param else "response_not_found")


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    def _owner(self, tenant: Any = None) -> str | None:
        """Whose stored responses this request sees: its tenant's (server/tenants)."""
        return self.serving.tenancy.engine_tenant(tenant or current_tenant())

    # ---- routes -------------------------------------------------------------------------------
    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        body.check_unsupported()
        history: list[Any] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, self._owner())
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        translation = translate(body, history)
        headers = {}
        if translation.dropped:
            logger.info("responses: tools not offered to the model (kvserve cannot run them): %s",
                        ", ".join(translation.dropped))
            headers[DROPPED_TOOLS_HEADER] = header_value(",".join(translation.dropped))
        try:
            run = await self.serving.prepare_chat(translation.chat, id_prefix="resp")
        except APIError as exc:
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
        conversation = [*history, *body.items()]
        if body.stream:
            return self.serving.pushed(run.jobs, translation.chat.cache_salt,
                                       ResponseFrames(self, body, translation, run, conversation), headers)
        response = await cancel_on_disconnect(raw, self._full(body, translation, run, conversation))
        response.headers.update(headers)
        return response

    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id, self._owner())
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id, self._owner()):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # ---- running ------------------------------------------------------------------------------
    async def _full(self, body: ResponsesRequest, translation: Translation, run: ChatRun,
                    conversation: list[Any]) -> Response:
        created = int(time.time())
        parser = run.think.parser() if run.think is not None else None
        reasoning, text = [], []
        try:
            async for _, out in self.serving.stream_outputs(run.jobs, translation.chat.cache_salt):
                if parser is not None:  # fed as it comes, to count the think block's tokens
                    r, c = parser.step(out)
                    reasoning.append(r)
                    text.append(c)
        except EngineRequestError as exc:
            raise APIError(exc.status, str(exc), exc.type, None, exc.code) from None
        choice = run.jobs[0].choice
        content = "".join(text) if parser is not None else choice.text
        message, _ = finish_message(run.plan, content, choice.finish_reason)
        builder = OutputBuilder()
        for _ in builder.feed({"reasoning_content": "".join(reasoning), "content": message.get("content"),
                               "tool_calls": message.get("tool_calls")}):
            pass
        incomplete = choice.finish_reason == "length"
        for _ in builder.finish(incomplete):
            pass
        return JSONResponse(self._finished(body, translation, run, created, builder, conversation,
                                           reasoning_tokens=parser.reasoning_tokens if parser else 0))

    def _finished(self, body: ResponsesRequest, translation: Translation, run: ChatRun, created: int,
                  builder: OutputBuilder, conversation: list[Any], response_id: str | None = None,
                  reasoning_tokens: int = 0) -> dict[str, Any]:
        """The finished Response (stored unless ``store`` is false)."""
        choice = run.jobs[0].choice
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        response = response_object(response_id or new_id("resp"), created, self.serving.model_name, body,
                                   translation.tools, status, builder.output,
                                   response_usage(usage([choice], prompt_lengths(run.jobs)), reasoning_tokens))
        if body.store is not False:
            self.store.put(response, [*conversation, *as_input_items(builder.output)], self._owner(run.jobs[0].tenant))
        return response


class ResponseFrames:
    """A streamed Response's typed events (``server.stream_frames.Frames``): ``response.created``
    and ``response.in_progress``, the output items' events as the text, reasoning and tool calls
    come, then their ends and ``response.completed`` (``response.incomplete`` at the length
    limit) with the same Response the non-streamed call returns; an engine error is an ``error``
    event, the last. Every event carries its ``sequence_number``."""

    def __init__(self, serving: ResponsesServing, body: ResponsesRequest, translation: Translation, run: ChatRun,
                 conversation: list[Any]) -> None:
        self.serving, self.body, self.translation, self.run, self.conversation = (serving, body, translation, run,
                                                                                  conversation)
        self.created = int(time.time())
        self.response_id = new_id("resp")
        self.sequence = 0
        self.builder = OutputBuilder()
        self.streamer = ToolStreamer(run.plan or ToolPlan("none", []))
        self.parser: ReasoningParser | None = run.think.parser() if run.think is not None else None

    def _event(self, kind: str, payload: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json_text(data)}\n\n"

    def _events(self, events: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
        return [self._event(kind, payload) for kind, payload in events]

    def opening(self) -> list[str]:
        start = response_object(self.response_id, self.created, self.serving.serving.model_name, self.body,
                                self.translation.tools, "in_progress", [], None)
        return [self._event("response.created", {"response": start}),
                self._event("response.in_progress", {"response": start})]

    def output(self, choice: Choice, out: RequestOutput) -> list[str]:
        reasoning, text = self.parser.step(out) if self.parser is not None else ("", out.text)
        frames = self._events(self.builder.feed({"reasoning_content": reasoning})) if reasoning else []
        frames += self._events(self.builder.feed(self.streamer.delta(text)))
        if out.finished:
            tail, _ = self.streamer.final(choice.finish_reason)
            frames += self._events(self.builder.feed(tail))
        return frames

    def closing(self) -> list[str]:
        incomplete = self.run.jobs[0].choice.finish_reason == "length"
        frames = self._events(self.builder.finish(incomplete))
        final = self.serving._finished(self.body, self.translation, self.run, self.created, self.builder,
                                       self.conversation, self.response_id,
                                       self.parser.reasoning_tokens if self.parser is not None else 0)
        return [*frames, self._event("response.incomplete" if incomplete else "response.completed",
                                     {"response": final})]

    def error(self, exc: EngineRequestError) -> list[str]:
        return [self._event("error", {"code": exc.code, "message": str(exc), "param": None})]
