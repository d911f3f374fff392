"""Chat and text completions: requests to engine calls, engine outputs to OpenAI responses.

One HTTP request becomes ``len(prompts) * n`` engine requests ("choices"), run concurrently
and merged. Closing the merged stream (client gone, error) cancels every choice, which
aborts its engine request and frees its blocks.

Every streamed response (here and in the Responses and Messages APIs) is pushed (``pushed``):
each engine output is made into its frames (``server/stream_frames.py``) and written where it
arrives (``server/push.py``), with no task or generator per token. Non-streamed responses read
the same outputs through ``stream_outputs``.

Bad input stays off the hot path: the prompt count and size are checked before tokenizing,
and tokenization and chat templates run in a worker thread, never on the event loop. The
429 budget counts engine requests (a request with ``n=8`` weighs 8).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.core.client import EngineClient, EngineDeadError
from engine.core.protocol import PromptTooLongError
from kvtypes.outputs import RequestOutput
from kvtypes.sampling_params import SamplingParams
from engine.tokenizer import TemplateError, encode_chat, encode_prompt
from server.access_log import current_record, engine_request_id
from server.cache_routes import chat_cache_policy, completion_cache_policy, has_disk_tier, with_policy
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.push import FrameWriter, PushedSSE
from server.stream_frames import ChatFrames, CompletionFrames, Frames
from server.logprobs import LogprobFormatter, concat_logprobs
from engine.sampling.structured_output import GrammarError, validate_spec
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.reasoning import ThinkMode, split, think_tags, think_token_ids
from server.runs import (ChatRun, Choice, EngineRequestError, Job, cancel_on_disconnect, checked, prompt_lengths,
                         usage, with_seed)
from server.tenants import Tenancy, current_tenant
from server.tools import ToolPlan, finish_message, plan_tools, render_messages

class OpenAIServing:
    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.reasons = think_tags(self.tokenizer)  # the model marks thinking with <think> tags
        self.think_ids = think_token_ids(self.tokenizer) if self.reasons else None
        # One worker: tokenization holds the GIL, more threads would only take turns.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenize")
        self.tenancy = Tenancy(config.api_key, config.api_key_file)
        # validate_spec's verdicts per spec (a frozen dataclass), least recently used first: load
        # generators and agents send the same schema with every request. None: the spec compiles;
        # else the error's message.
        self._spec_verdicts: OrderedDict[Any, str | None] = OrderedDict()

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks shared by every endpoint ----------------------------------------------------
    def check_api_key(self, authorization: str | None, right: str = "inference") -> None:
        """401 without a valid key, 403 when its tenant lacks ``right``; sets the current tenant."""
        self.tenancy.authenticate(authorization, right)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           "invalid_request_error", "model", "model_not_found")

    def check_capacity(self, weight: int = 1) -> None:
        """503 while the engine is down; 429 when ``weight`` more engine requests would overflow the queue."""
        if not self.engine.is_healthy:
            raise APIError(503, "the engine is not available right now; retry later", "service_unavailable_error",
                           None, "engine_unavailable", headers={"Retry-After": "5"})
        waiting = self.engine.num_waiting
        if waiting + weight > self.config.max_waiting:
            self.tenancy.rejected(current_tenant(), "overloaded")
            raise APIError(429, f"the server is overloaded ({waiting} engine requests waiting, this request adds "
                           f"{weight}); retry later", "rate_limit_error", None, "rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    def _evicts(self, params: SamplingParams) -> bool:
        """Whether the engine's eviction policy applies to a request (then the context does not
        bound its prompt + max_tokens); False where it cannot (validation then says why)."""
        info = getattr(self.engine, "info", None)
        try:
            return bool(info is not None and info.evicts(params))
        except ValueError:
            return False

    def _validate_prompt(self, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            self.engine.validate(prompt_ids, params)
        except PromptTooLongError as exc:
            raise bad_request(str(exc), param, "context_length_exceeded") from None
        except ValueError as exc:
            message = str(exc)
            named = next((f for f in ("logit_bias", "kv_eviction") if message.startswith(f)), param)
            raise bad_request(message, named) from None

    async def _check_spec(self, spec: Any, what: str, param: str) -> None:
        """400 naming ``param`` for a schema / regex / grammar that cannot compile (checked
        without a tokenizer, once per distinct spec). A spec not seen before is checked off the
        event loop: a 40-property schema takes ~2 ms (large ones tens of ms), llguidance releases
        the GIL meanwhile, and the loop goes on streaming every other request's tokens."""
        verdicts = self._spec_verdicts
        error = verdicts.get(spec, _UNSEEN)
        if error is _UNSEEN:
            error = await self._off_loop(_spec_error, spec)
            verdicts[spec] = error
            if len(verdicts) > _MAX_SPEC_VERDICTS:
                verdicts.popitem(last=False)
        else:
            verdicts.move_to_end(spec)
        if error is not None:
            raise bad_request(f"invalid {what}: {error}", param)

    async def _check_tool_schemas(self, plan: ToolPlan) -> None:
        """Every function's ``parameters`` must compile, as OpenAI refuses an invalid function
        schema under any ``tool_choice``."""
        for name, spec in plan.parameter_specs():
            await self._check_spec(spec, f"tools: function {name!r}", "tools")

    async def _check_grammar(self, params: SamplingParams, param: str) -> None:
        """The request's own grammar (a response_format, a guided_* field or a forced tool call)."""
        if params.structured_output is not None:
            await self._check_spec(params.structured_output, param, param)

    @property
    def _template_has_tools(self) -> bool:
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    # ---- endpoints --------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        run = await self.prepare_chat(body)
        if body.stream:
            return self.pushed(run.jobs, body.cache_salt, ChatFrames(run.request_id, self.model_name, run.jobs, body,
                                                                      self.logprobs, run.plan, run.think))
        return await cancel_on_disconnect(raw, self._chat_full(run.request_id, run.jobs, body, run.plan, run.think))

    async def prepare_chat(self, body: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                           clamp_max_tokens: bool = False, admit: bool = True) -> ChatRun:
        """Validate a chat request, render and tokenize it, and plan its jobs (one per choice):
        everything before the engine runs. Other chat-shaped APIs (Responses, Messages) translate
        their requests into a ``ChatCompletionRequest`` and run it through here, so they share
        the scheduler, prefix cache, grammars and tools with chat completions.

        ``clamp_max_tokens``: a ``max_tokens`` beyond the context's room (the context length, or
        the KV pool when smaller, minus the prompt) is lowered to it instead of refused
        (Anthropic clients send 32000).

        ``admit``: take the tenant's limits (server/tenants); the run's response must end
        through ``stream_outputs``, which releases them (count_tokens runs nothing: False)."""
        self.check_model(body.model)
        body.check_unsupported()
        priority = self._priority(body)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        if plan is not None:
            await self._check_tool_schemas(plan)
        # auto's lazy call grammar only when the request has no grammar of its own
        own = plan is not None and plan.mode == "auto" and (
            (body.response_format is not None and body.response_format.type != "text")
            or body.guided_spec() is not None)
        forced = plan.spec(constrain_auto=not own) if plan is not None else None
        params = body.to_sampling_params(self.config.max_stop, forced)
        budget = body.reasoning_budget()
        await self._check_grammar(params, "tools" if forced is not None else "response_format")
        self._check_n(body.n)
        if not body.messages:
            raise bad_request("messages must contain at least one message", "messages")
        with_tools = self._template_has_tools
        messages = render_messages(body.messages, plan, with_tools)
        chars = sum(len(m["content"]) if isinstance(m.get("content"), str) else len(str(m.get("content") or ""))
                    for m in messages)
        if chars > self.config.max_prompt_chars:
            raise bad_request(f"the messages hold {chars} characters; at most {self.config.max_prompt_chars} "
                              "are accepted", "messages", "context_length_exceeded")
        self.check_capacity(body.n)
        tools = plan.tools if plan is not None and plan.shows_tools and with_tools else None
        try:
            prompt_ids = await self._off_loop(lambda: encode_chat(self.tokenizer, messages, tools=tools,
                                                                  template_kwargs=body.chat_template_kwargs))
        except TemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        if clamp_max_tokens and params.max_tokens is not None and not self._evicts(params):
            info = getattr(self.engine, "info", None)  # the pool may hold less than a context
            room = min(self.engine.max_model_len, getattr(info, "num_tokens", None) or self.engine.max_model_len) \
                - len(prompt_ids)
            if 0 < room < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=room)
        params = with_policy(params, chat_cache_policy(body, self.tokenizer, messages, prompt_ids,
                                                       has_disk_tier(self.engine)))
        self._validate_prompt(prompt_ids, params, "messages")
        request_id = engine_request_id(id_prefix)
        think = None
        if self.reasons:
            think = ThinkMode.for_prompt(self.tokenizer, prompt_ids)
            if self.think_ids is not None and (budget is not None or params.structured_output is not None):
                params = dataclasses.replace(params, reasoning=think.spec(self.think_ids, budget))
        jobs = self._jobs(request_id, [prompt_ids], params, body.n, priority)
        if admit:
            await self.tenancy.admit(current_tenant(), jobs, self.engine.max_model_len)
        return ChatRun(request_id, jobs, plan, think)

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        body.check_unsupported()
        priority = self._priority(body)
        params = body.to_sampling_params(self.config.max_stop)
        await self._check_grammar(params, "response_format")
        params = with_policy(params, completion_cache_policy(body, has_disk_tier(self.engine)))
        self._check_n(body.n)
        raw_prompts = body.prompts()
        if len(raw_prompts) > self.config.max_prompts:
            raise bad_request(f"at most {self.config.max_prompts} prompts per request, got {len(raw_prompts)}",
                              "prompt")
        if len(raw_prompts) * body.n > self.config.max_n * 4:
            raise bad_request(f"too many choices: {len(raw_prompts)} prompts x n={body.n}", "prompt")
        for prompt in raw_prompts:
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
                raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")
        chars = sum(len(p) for p in raw_prompts if isinstance(p, str))
        if chars > self.config.max_prompt_chars:
            raise bad_request(f"the prompts hold {chars} characters; at most {self.config.max_prompt_chars} are "
                              "accepted", "prompt", "context_length_exceeded")
        self.check_capacity(len(raw_prompts) * body.n)
        texts = [p for p in raw_prompts if isinstance(p, str)]
        encoded = iter(await self._off_loop(lambda: [encode_prompt(self.tokenizer, t) for t in texts]) if texts else [])
        prompts = []
        for prompt in raw_prompts:
            ids = next(encoded) if isinstance(prompt, str) else list(prompt)
            self._validate_prompt(ids, params, "prompt")
            prompts.append(ids)
        request_id = engine_request_id("cmpl")
        jobs = self._jobs(request_id, prompts, params, body.n, priority)
        await self.tenancy.admit(current_tenant(), jobs, self.engine.max_model_len)
        if body.echo:
            for job in jobs:
                prompt = body.prompts()[job.choice.prompt_index]
                job.choice.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        if body.stream:
            return self.pushed(jobs, body.cache_salt, CompletionFrames(request_id, self.model_name, jobs, body,
                                                                        self.logprobs))
        return await cancel_on_disconnect(raw, self._completion_full(request_id, jobs, body))

    def _check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise bad_request(f"n must be at most {self.config.max_n}, got {n}", "n")

    def _priority(self, body: Any) -> int:
        """The engine priority of ``body`` (its ``priority`` capped by the tenant's floor); also
        refuses a request ``cache_salt`` in the tenants' reserved namespace."""
        self.tenancy.check_request_salt(getattr(body, "cache_salt", None))
        policy = getattr(getattr(self.engine, "info", None), "scheduling_policy", "fcfs")
        return self.tenancy.priority(current_tenant(), getattr(body, "priority", 0) or 0, policy)

    def _jobs(self, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
              priority: int = 0) -> list[Job]:
        jobs = []
        for p, ids in enumerate(prompts):
            for k in range(n):
                # Distinct seeds per choice, or n seeded choices would all be the same text.
                seed = None if params.seed is None else params.seed + k
                choice_params = params if seed == params.seed else with_seed(params, seed)
                choice = Choice(index=p * n + k, prompt_index=p, num_prompt_tokens=len(ids))
                jobs.append(Job(choice, ids, choice_params, f"{request_id}-{p * n + k}", priority))
        return jobs

    # ---- running choices --------------------------------------------------------------------
    async def stream_outputs(self, jobs: list[Job],
                             cache_salt: str | None) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Outputs of all jobs as they come; raises EngineRequestError on an engine failure.

        One job (the common case) is read directly, with no task or queue between the engine's
        stream and the response (one task switch less a token); several are pumped into one queue
        by a task each. Either way, leaving early closes the engine streams (their requests abort).

        The jobs run under their tenant (``Job.tenant``, set at admission): its salt goes before
        ``cache_salt`` in the prefix-cache chain, and the end of the stream releases its limits."""
        salt, owner = self._salt_and_owner(jobs, cache_salt)
        record = current_record()
        unfinished = "cancelled"  # the finish reason of a choice the engine did not end: the stream was left
        try:
            async with contextlib.aclosing(self._stream_jobs(jobs, salt, owner)) as items:
                async for item in items:
                    if record is not None and item[1].num_output_tokens:
                        record.first_token()
                    yield item
        except EngineRequestError as exc:
            unfinished = "abort" if exc.status == 503 else "error"
            raise
        finally:
            self._run_ended(jobs, record, unfinished)

    def _salt_and_owner(self, jobs: list[Job], cache_salt: str | None) -> tuple[str | None, str | None]:
        """The prefix-cache salt (the jobs' tenant's before ``cache_salt``) and the engine tenant."""
        tenant = jobs[0].tenant if jobs else None
        if tenant is None:
            return cache_salt, None
        return tenant.cache_salt(cache_salt), self.tenancy.engine_tenant(tenant)

    def _run_ended(self, jobs: list[Job], record: Any, unfinished: str) -> None:
        """A run's end, however it ended: the tenant's limits released, the access line's counts."""
        self.tenancy.ended(jobs)
        if record is not None and jobs:
            counts = usage([j.choice for j in jobs], prompt_lengths(jobs))
            record.engine_ran(counts["prompt_tokens"], counts["prompt_tokens_details"]["cached_tokens"],
                              counts["completion_tokens"], [j.choice.finish_reason or unfinished for j in jobs])

    def pushed(self, jobs: list[Job], cache_salt: str | None, frames: Frames,
               headers: dict[str, str] | None = None) -> PushedSSE:
        """The streamed response of ``jobs``: their outputs made into ``frames`` and written where
        they arrive (server/push.py), with no task or generator per token. Every SSE endpoint
        streams through here; the bookkeeping is ``stream_outputs``'."""
        return PushedSSE(lambda writer: self._push_run(jobs, cache_salt, frames, writer), headers)

    def _push_run(self, jobs: list[Job], cache_salt: str | None, frames: Frames,
                  writer: FrameWriter) -> Callable[[], None]:
        """Start every job with its outputs written by ``writer`` as they come; returns the run's
        ``close`` (aborts the jobs still running, releases the tenant's limits, fills the access
        line)."""
        salt, owner = self._salt_and_owner(jobs, cache_salt)
        record = current_record()
        ends: list[tuple[Job, Callable[[bool], None]]] = []
        last_seen: set[int] = set()  # choices whose final output arrived
        state = {"unfinished": "cancelled", "running": len(jobs)}

        def write_last(last: list[str]) -> None:
            for frame in last:
                writer.write(frame)
            writer.end()

        def failed(exc: EngineRequestError) -> None:
            state["unfinished"] = "abort" if exc.status == 503 else "error"
            write_last(frames.error(exc))

        def sink(job: Job, out: RequestOutput) -> None:
            if out.finished:
                last_seen.add(job.choice.index)
            if writer.ended:  # an error ended the stream: the other choices' outputs are moot
                return
            try:
                try:
                    checked(job.choice, out)
                except EngineRequestError as exc:
                    return failed(exc)
                if record is not None and record.first_token_at is None and out.num_output_tokens:
                    record.first_token()
                for frame in frames.output(job.choice, out):
                    writer.write(frame)
                if out.finished:
                    state["running"] -= 1
                    if not state["running"]:
                        write_last(frames.closing())
            except Exception as exc:  # noqa: BLE001 - a formatting bug fails this response, not the step's others
                writer.fail(exc)

        for frame in frames.opening():
            writer.write(frame)
        for job in jobs:
            try:
                ends.append((job, self.engine.push(job.prompt_token_ids, job.params, functools.partial(sink, job),
                                                   job.request_id, salt, job.priority, owner)))
            except (EngineDeadError, ValueError) as exc:
                failed(EngineRequestError(str(exc)))
                break

        def close() -> None:
            for job, end in ends:
                end(job.choice.index in last_seen)
            self._run_ended(jobs, record, state["unfinished"])
        return close

    async def _stream_jobs(self, jobs: list[Job], cache_salt: str | None,
                           tenant: str | None) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        if len(jobs) == 1:
            job = jobs[0]
            try:
                async with contextlib.aclosing(self.engine.generate(job.prompt_token_ids, job.params, job.request_id,
                                                                    cache_salt, job.priority, tenant)) as outputs:
                    async for out in outputs:
                        yield job.choice, checked(job.choice, out)
            except (EngineDeadError, ValueError) as exc:
                raise EngineRequestError(str(exc)) from None
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async for out in self.engine.generate(job.prompt_token_ids, job.params, job.request_id, cache_salt,
                                                      job.priority, tenant):
                    queue.put_nowait((job.choice, out))
            except (EngineDeadError, ValueError) as exc:
                queue.put_nowait((job.choice, exc))
            finally:
                queue.put_nowait((job.choice, None))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise EngineRequestError(str(item))
                else:
                    yield choice, checked(choice, item)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_to_end(self, jobs: list[Job], cache_salt: str | None) -> None:
        try:
            async for _ in self.stream_outputs(jobs, cache_salt):
                pass
        except EngineRequestError as exc:
            raise APIError(exc.status, str(exc), exc.type, None, exc.code) from None

    # ---- chat responses -----------------------------------------------------------------------
    async def _chat_full(self, request_id: str, jobs: list[Job], body: ChatCompletionRequest,
                         plan: ToolPlan | None = None, think: ThinkMode | None = None) -> Response:
        created = int(time.time())
        await self._run_to_end(jobs, body.cache_salt)
        choices = [j.choice for j in jobs]
        rendered = []
        for c in choices:
            reasoning, text = split(c.text, think) if think is not None else (None, c.text)
            message, finish_reason = finish_message(plan, text, c.finish_reason)
            if think is not None:  # vLLM's two names for the same text
                message["reasoning_content"] = message["reasoning"] = reasoning
            rendered.append({"index": c.index, "message": message,
                             "logprobs": self.logprobs.chat(c.logprobs) if body.logprobs else None,
                             "finish_reason": finish_reason})
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": rendered, "usage": usage(choices, prompt_lengths(jobs)),
        })

    # ---- completion responses -----------------------------------------------------------------
    async def _completion_full(self, request_id: str, jobs: list[Job], body: CompletionRequest) -> Response:
        created = int(time.time())
        await self._run_to_end(jobs, body.cache_salt)
        choices = [j.choice for j in jobs]
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": [{"index": c.index, "text": (c.echo or "") + c.text,
                         "logprobs": self._echoed_logprobs(c, jobs) if body.logprobs is not None else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(choices, prompt_lengths(jobs)),
        })

    # ---- formatting helpers -------------------------------------------------------------------
    def _echoed_logprobs(self, choice: Choice, jobs: list[Job]) -> dict[str, Any]:
        output = self.logprobs.completion(choice.logprobs)
        if choice.echo is None or choice.prompt_logprobs is None:
            return output
        job = next(j for j in jobs if j.choice is choice)
        return concat_logprobs(self.logprobs.prompt(job.prompt_token_ids, choice.prompt_logprobs), output)


_MAX_SPEC_VERDICTS = 1024  # OpenAIServing._spec_verdicts' size
_UNSEEN = object()


def _spec_error(spec: Any) -> str | None:
    try:
        validate_spec(spec)
    except GrammarError as exc:
        return str(exc)
    return None
