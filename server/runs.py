"""What one HTTP request runs on the engine: its choices (one engine request each, ``Job``),
their accumulated text and counts (``Choice``), the OpenAI ``usage`` they add up to, and
cancelling the run when the client leaves. Shared by every endpoint that runs the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Awaitable, Sequence

from fastapi import Request
from fastapi.responses import Response

from kvtypes.outputs import RequestOutput, TokenLogprob
from kvtypes.sampling_params import SamplingParams
from server.reasoning import ThinkMode
from server.tools import ToolPlan


class EngineRequestError(RuntimeError):
    """The engine failed (500) or, shutting down, aborted (503) this request after it was accepted."""

    def __init__(self, message: str, status: int = 500, code: str = "engine_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code

    @property
    def type(self) -> str:
        return "service_unavailable_error" if self.status == 503 else "internal_server_error"


@dataclass
class Choice:
    index: int
    prompt_index: int
    parts: list[str] = field(default_factory=list)  # the output text as it came (``text`` joins it)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0
    num_evicted_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo + logprobs on /v1/completions
    echo: str | None = None  # the prompt text, when echo is asked
    echoed: bool = False  # streaming: the echo went out with the first chunk

    @property
    def text(self) -> str:
        """The output text so far (joined here: appending to one string copied it every token)."""
        return "".join(self.parts)


@dataclass
class Job:
    """One engine request of an HTTP request."""

    choice: Choice
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0  # the engine priority (the request's, capped by its tenant's floor)
    tenant: Any = None  # server.tenants.Tenant, set at admission
    lease: Any = None  # server.tenants.limits.Lease, released when the response ends


@dataclass
class ChatRun:
    """A validated, tokenized chat request ready to run: its id, one job per choice, its tools,
    and how its output reasons (None: the model has no think tags, its output is all content)."""

    request_id: str
    jobs: list[Job]
    plan: ToolPlan | None
    think: ThinkMode | None = None


def usage(choices: Sequence[Choice], prompt_lengths: Sequence[int]) -> dict[str, Any]:
    prompt_tokens = sum(prompt_lengths)
    completion = sum(c.num_output_tokens for c in choices)
    # Counted once per prompt (its first choice), like prompt_tokens.
    firsts = [c for c in choices if c.index == c.prompt_index * (len(choices) // len(prompt_lengths))]
    cached = sum(c.num_cached_tokens for c in firsts)
    written = sum(c.num_cache_write_tokens for c in choices)  # tokens written into retained cache
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written}}
    evicted = sum(c.num_evicted_tokens for c in choices)
    if evicted:  # kvserve's extension: tokens whose KV --kv-eviction dropped (docs/api.md)
        out["evicted_tokens"] = evicted
    return out


def checked(choice: Choice, out: RequestOutput) -> RequestOutput:
    """``out`` applied to its choice; an engine error or abort raises EngineRequestError."""
    if out.finish_reason == "error":
        raise EngineRequestError(out.error or "engine error")
    if out.finish_reason == "abort":
        # Only the engine stopping aborts a request someone still listens to (a client that
        # left is not listening); "abort" is no OpenAI finish_reason.
        raise EngineRequestError(out.error or "the request was aborted: the server is shutting down",
                                 503, "server_shutting_down")
    apply(choice, out)
    return out


def apply(choice: Choice, out: RequestOutput) -> None:
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    if out.text:
        choice.parts.append(out.text)
    choice.num_output_tokens = out.num_output_tokens
    choice.num_cached_tokens = out.num_cached_tokens
    choice.num_cache_write_tokens = out.num_cache_write_tokens
    choice.num_evicted_tokens = out.num_evicted_tokens
    if out.logprobs:
        choice.logprobs.extend(out.logprobs)
    if out.finished:
        choice.finish_reason = out.finish_reason


def prompt_lengths(jobs: list[Job]) -> list[int]:
    seen: dict[int, int] = {}
    for job in jobs:
        seen.setdefault(job.choice.prompt_index, len(job.prompt_token_ids))
    return list(seen.values())


def with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


async def cancel_on_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)
