"""The SSE frames of a streamed response, made per engine output: the ``Frames`` contract, and
the chat and text completion formatters (the Responses and Messages APIs have theirs beside
their endpoints).

A formatter holds one response's state (tool-call streamers, reasoning parsers, logprob
offsets, the echo, event numbers) and turns each ``(choice, output)`` into the frames it adds,
in its API's shapes. It does no I/O: the run that feeds it (``OpenAIServing.pushed``) writes the
frames as they come and then ends the response.
"""
from __future__ import annotations

from typing import Any, Protocol

from server.errors import sse_error_frame
from server.logprobs import LogprobFormatter, concat_logprobs
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.reasoning import ReasoningParser, ThinkMode
from server.runs import Choice, EngineRequestError, Job, prompt_lengths, usage
from server.sse import ChunkWriter
from server.tools import ToolPlan, ToolStreamer
from kvtypes.outputs import RequestOutput

DONE = "data: [DONE]\n\n"


class Frames(Protocol):
    """One streamed response's frames. Per response: ``opening()``; then ``output`` for every
    engine output in arrival order (``checked`` has applied it to its choice); then, once every
    choice finished, ``closing()``, the stream's last frames; or, at the first engine error,
    ``error(exc)`` instead, also the last."""

    def opening(self) -> list[str]: ...
    def output(self, choice: Choice, out: RequestOutput) -> list[str]: ...
    def closing(self) -> list[str]: ...
    def error(self, exc: EngineRequestError) -> list[str]: ...


def openai_error(exc: EngineRequestError) -> list[str]:
    """An engine error inside an OpenAI stream: its error frame, then ``[DONE]``."""
    return [sse_error_frame(str(exc), exc.type, exc.code), DONE]


class ChatFrames:
    """``chat.completion.chunk`` frames: a role delta per choice first, then content, reasoning
    (its own chunk, before the output's content) and tool-call deltas, the finish reason on the
    choice's last chunk, and the usage chunk when ``stream_options.include_usage`` asks."""

    def __init__(self, request_id: str, model: str, jobs: list[Job], body: ChatCompletionRequest,
                 logprobs: LogprobFormatter, plan: ToolPlan | None, think: ThinkMode | None) -> None:
        self.jobs, self.body, self.logprobs = jobs, body, logprobs
        self.usage_on = body.include_usage_in_stream()
        self.chunk = ChunkWriter(request_id, "chat.completion.chunk", model, self.usage_on)
        self.streamers = {j.choice.index: ToolStreamer(plan or ToolPlan("none", [])) for j in jobs}
        self.parsers: dict[int, ReasoningParser] = {j.choice.index: think.parser() for j in jobs} if think else {}

    def opening(self) -> list[str]:
        return [self.chunk.delta(job.choice.index, {"role": "assistant", "content": ""}) for job in self.jobs]

    def output(self, choice: Choice, out: RequestOutput) -> list[str]:
        want_logprobs = self.body.logprobs
        if not (out.text or out.finished or (want_logprobs and out.logprobs)):
            return []
        frames = []
        index = choice.index
        text = out.text
        if self.parsers:  # the reasoning goes out in its own chunk, before this output's content
            reasoning, text = self.parsers[index].step(out)
            if reasoning:
                frames.append(self.chunk.delta(index, {"reasoning_content": reasoning, "reasoning": reasoning}))
        streamer = self.streamers[index]
        delta = streamer.delta(text)
        finish_reason = None
        if out.finished:
            tail, finish_reason = streamer.final(choice.finish_reason)
            if tail:
                if delta:  # one delta per chunk: send what streamed first
                    frames.append(self.chunk.delta(index, delta))
                delta = tail
        logprobs = self.logprobs.chat(out.logprobs or []) if want_logprobs else None
        if delta or out.finished or logprobs:
            frames.append(self.chunk.delta(index, delta, logprobs, finish_reason))
        return frames

    def closing(self) -> list[str]:
        return _usage_and_done(self.chunk, self.jobs, self.usage_on)

    error = staticmethod(openai_error)


class CompletionFrames:
    """``text_completion`` frames: one per output with text (the echoed prompt first, once), the
    finish reason on the choice's last, logprobs with running text offsets, and the usage chunk."""

    def __init__(self, request_id: str, model: str, jobs: list[Job], body: CompletionRequest,
                 logprobs: LogprobFormatter) -> None:
        self.jobs, self.body, self.logprobs = jobs, body, logprobs
        self.usage_on = body.include_usage_in_stream()
        self.chunk = ChunkWriter(request_id, "text_completion", model, self.usage_on)
        self.offsets = {j.choice.index: 0 for j in jobs}

    def opening(self) -> list[str]:
        return []

    def output(self, choice: Choice, out: RequestOutput) -> list[str]:
        want_logprobs = self.body.logprobs is not None
        if not (out.text or out.finished or (want_logprobs and out.logprobs)):
            return []
        logprobs: Any = None
        text = out.text
        echo = choice.echo is not None and not choice.echoed  # the prompt goes first, once
        if echo:
            choice.echoed = True
            text = (choice.echo or "") + text
        if want_logprobs:
            logprobs = self.logprobs.completion(out.logprobs or [], self.offsets[choice.index])
            if echo and out.prompt_logprobs is not None:
                job = next(j for j in self.jobs if j.choice is choice)
                logprobs = concat_logprobs(self.logprobs.prompt(job.prompt_token_ids, out.prompt_logprobs), logprobs)
            self.offsets[choice.index] += sum(len(t) for t in logprobs["tokens"])
        return [self.chunk.text(choice.index, text, logprobs, choice.finish_reason if out.finished else None)]

    def closing(self) -> list[str]:
        return _usage_and_done(self.chunk, self.jobs, self.usage_on)

    error = staticmethod(openai_error)


def _usage_and_done(chunk: ChunkWriter, jobs: list[Job], usage_on: bool) -> list[str]:
    """The end of an OpenAI stream: the usage chunk when asked, then ``[DONE]``."""
    counts = [chunk([], usage([j.choice for j in jobs], prompt_lengths(jobs)))] if usage_on else []
    return [*counts, DONE]
