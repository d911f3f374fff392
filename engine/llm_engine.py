"""The synchronous engine: requests in, one scheduled forward pass per ``step()``, outputs out.

It is driven by one thread only: the engine core's loop (``engine/core/loop.py``, in its own
process or, in-process mode, in a thread), or the CLI's offline ``generate``. ``step()``
returns token ids only; text (detokenization, stop strings) is the output processor's job.
Building one (model, pool, tiers, scheduler) is ``engine/builder.py``'s job; its stats
snapshots are ``engine/stats.py``'s.

Fault contract of ``step()``: if the forward pass raises, the step's requests are retried one
by one; those that raise again finish with ``error`` (blocks freed, detail logged), the others
go on as if nothing happened. Any other exception propagates (the engine state may be broken).
"""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Sequence

from cache.tiers import KVTier, tier_members
from engine.builder import EngineParts, build_engine_parts
from engine.config import EngineConfig
from engine.core.output_processor import OutputProcessor
from engine.core.protocol import EngineCoreOutput, StepStats
from engine.loader import LoadedModel
from engine.model.runner import SampledToken
from engine.sampling.reasoning import ReasoningState, needs_state
from engine.sampling.structured_output import RequestGrammar
from engine.stats import StatsReporter
from engine.tokenizer import encode_prompt
from kvtypes.outputs import TokenLogprob
from kvtypes.sampling_params import SamplingParams
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


# Test-only fault hook: when set, a step that runs a request whose prompt starts with this
# token id raises (see tests/server/test_core_faults.py). Unset in production: one None check.
# bandit B105: a variable's name (a token id), no secret
FAULT_TOKEN_ENV = "KVSERVE_TEST_FAULT_TOKEN"  # nosec B105
# An evicting request without a cap on its length (--kv-max-request-tokens unset) runs until EOS.
UNLIMITED_TOKENS = 1 << 62


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    num_cache_write_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | EngineParts, loaded: LoadedModel | None = None) -> None:
        """Build the engine ``config`` describes (``loaded``: weights already in memory), or run
        ``EngineParts`` built already (engine/builder.py)."""
        parts = config if isinstance(config, EngineParts) else build_engine_parts(config, loaded)
        self.config = parts.config
        self.arch = parts.arch
        self.tokenizer = parts.tokenizer
        self.model_name = parts.model_name
        self.max_model_len = parts.max_model_len
        self.runner = parts.runner
        self.capacity = parts.capacity
        self.kv_cache = parts.kv_cache
        self.scheduler = parts.scheduler
        self.offloader = parts.offloader
        self.disk_tier = parts.disk_tier
        self._host_arena = parts.host_arena  # the host tier's memory
        self.grammars = parts.grammars
        self.info = parts.info
        # Requests whose grammar is not compiled yet wait here (the scheduler skips them).
        self._compiling: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens run by the latest step (for the iteration_tokens metric)
        fault = os.environ.get(FAULT_TOKEN_ENV)
        self.fault_token_id: int | None = int(fault) if fault else None
        self._stats = StatsReporter(self.scheduler, self.kv_cache, self.capacity)

    def close(self) -> None:
        """Write the device pool's and the host tier's cached blocks to the disk tier (so a restart
        finds every prefix, not only the evicted ones), finish pending writes and stop the tier
        threads; with tensor parallelism, stop the other ranks (idempotent; the engine cannot step
        afterwards)."""
        if self.offloader is not None:
            self.offloader.offload(self.kv_cache.take_offloads())
            cached = [(h, block.block_id) for h, block in self.kv_cache.block_pool.cached_blocks.items()]
            self.offloader.spill(cached, self.disk_tier)
            self.offloader.close()
            self.offloader = None
        self.runner.model.close()  # tensor parallelism: stop the other ranks

    def watch_ranks(self, on_lost) -> bool:  # noqa: ANN001 - Callable[[int, int | None], None]
        """With tensor parallelism, call ``on_lost(rank, exitcode)`` when another rank dies (the
        engine cannot step any more); False (and nothing watched) with a single rank."""
        return self.runner.model.watch_ranks(on_lost)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, tenant: str | None = None) -> str:
        """Validate and enqueue; raise ValueError (PromptTooLongError for length) with a user-facing message."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        self.validate_prompt(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        evicts = self.info.evicts(params)
        limit = (self.info.kv_max_request_tokens or UNLIMITED_TOKENS) if evicts else self.max_model_len
        room = limit - len(prompt_ids)
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params,
                          max_tokens=min(params.max_tokens or room, room),
                          eos_token_ids=self.arch.eos_token_ids, cache_salt=cache_salt, priority=priority,
                          tenant=tenant, evicts=evicts, max_total_tokens=limit if evicts else None)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.structured_output is not None:
            request.grammar = RequestGrammar(self.grammars.submit(params.structured_output))
        if needs_state(params.reasoning, request.grammar is not None):
            request.reasoning = ReasoningState(params.reasoning)
        self.scheduler.add_request(request)
        if request.grammar is not None:
            self._compiling[request_id] = request
        return request_id

    def validate_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.info.validate(prompt_ids, params)

    def abort(self, request_id: str, stopped: bool = False) -> EngineCoreOutput | None:
        """Free a live request's blocks now; returns its final output, or None if it was not live.
        ``stopped``: it ended on a stop string (found by the output processor), so it finishes as
        ``stop`` and its cache policy applies; otherwise as ``abort``."""
        request = self.scheduler.requests.get(request_id)
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        if request is None or not self.scheduler.finish_requests([request_id], status):
            return None
        return self._final(request)

    def abort_all(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[EngineCoreOutput]:
        live = list(self.scheduler.requests)
        return [self._final(request) for request in self.scheduler.finish_requests(live, status)]

    def _final(self, request: Request) -> EngineCoreOutput:
        self.runner.release(request.request_id)
        self._compiling.pop(request.request_id, None)
        return self._output(request, [])

    @staticmethod
    def _output(request: Request, new_token_ids: list[int], logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob] | None = None, error: str | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=new_token_ids,
                                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                logprobs=logprobs, num_prompt_tokens=request.num_prompt_tokens,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                num_cache_write_tokens=request.num_cache_write_tokens,
                                num_evicted_tokens=request.num_evicted_tokens,
                                first_scheduled_time=request.first_scheduled_time,
                                prompt_logprobs=prompt_logprobs, error=error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _tiers(self) -> list[KVTier]:
        """The lower tiers, top first (host, disk), each reporting its own stats."""
        return tier_members(self.offloader.tier) if self.offloader is not None else []

    def stats_changed(self) -> bool:
        """Whether a snapshot now would differ from the previous one in pins or counters
        (the idle core sends one then; pin expiry times alone do not count)."""
        return self._stats.changed(self._tiers())

    def stats(self, step_time_s: float = 0.0, num_batched_tokens: int = 0) -> StepStats:
        """The snapshot sent with each message: gauges now, counters as deltas since the last call
        (latency observations: those since the last call); ``num_batched_tokens`` and
        ``step_time_s`` describe the step it follows (0: no step)."""
        return self._stats.snapshot(self._tiers(), step_time_s, num_batched_tokens)

    def unpin(self, block_hash: str) -> bool:
        """Ask for a pin's release (applied by ``housekeeping`` / the next schedule); False if unknown."""
        return self.kv_cache.request_unpin(block_hash)

    # ---- the step -------------------------------------------------------------------------
    def _execute(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        if self.fault_token_id is not None and any(
                s.request.prompt_token_ids[0] == self.fault_token_id for s in plan.scheduled):
            raise RuntimeError(f"injected test fault ({FAULT_TOKEN_ENV})")
        return self.runner.execute(plan)

    def _execute_isolated(self, plan: SchedulerOutput) -> tuple[dict[str, SampledToken], list[Request]]:
        """Rerun a failed step's requests one at a time; return the samples and the requests that fail alone.

        Rerunning is exact: the failed pass wrote K/V only into the same slots the reruns write."""
        sampled: dict[str, SampledToken] = {}
        failed: list[Request] = []
        for item in plan.scheduled:
            try:
                sampled.update(self._execute(SchedulerOutput(scheduled=[item])))
            except Exception:  # noqa: BLE001 - the fault belongs to this request only
                logger.exception("engine step failed for request %s", item.request.request_id)
                failed.append(item.request)
        return sampled, failed

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, apply the sampled tokens; return per-request outputs."""
        if self.offloader is not None:
            self._finish_loads()
        outputs = self._resolve_grammars()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_batched_tokens
        if self.offloader is not None:
            # Evicted / written-through blocks still hold their contents until the forward pass.
            self.offloader.offload(self.kv_cache.take_offloads())
            for request, blocks in plan.loads:
                self.offloader.submit_load(request.request_id, blocks)
        if plan.is_empty:
            return outputs
        failed: list[Request] = []
        try:
            sampled = self._execute(plan)
        except Exception:  # noqa: BLE001 - isolate the requests that cause it
            logger.exception("engine step of %d requests failed; retrying them one by one", len(plan.scheduled))
            sampled, failed = self._execute_isolated(plan)
        if failed:
            failed_ids = {r.request_id for r in failed}
            plan.scheduled = [s for s in plan.scheduled if s.request.request_id not in failed_ids]
            for request in self.scheduler.finish_requests(list(failed_ids), RequestStatus.FINISHED_ERROR):
                outputs.append(self._final(request))
        for rid, mass in self.runner.take_block_mass().items():  # h2o: before eviction plans read it
            self.kv_cache.add_block_mass(rid, mass)
        touched = self.scheduler.update(plan, {rid: s.token_id for rid, s in sampled.items()},
                                        {rid: s.run_token_ids for rid, s in sampled.items()
                                         if s.run_token_ids is not None})
        for request in touched:
            rid = request.request_id
            new_tokens = self.scheduler.new_token_ids[rid]  # one, or a speculative run (no grammar, no logprobs)
            token = new_tokens[-1]
            answer = request.reasoning.accept(token) if request.reasoning is not None else True
            if request.grammar is not None and answer and not request.status.is_finished:
                self._advance_grammar(request, token)
            finished = request.status.is_finished
            sample = sampled[rid]
            logprobs = None
            if sample.logprob is not None:
                logprobs = [TokenLogprob(token, sample.logprob, sample.top_logprobs or [])]
            prompt_logprobs = None
            if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1:
                prompt_logprobs = list(request.prompt_logprobs)
            error = request.grammar.error if request.grammar is not None and finished else None
            outputs.append(self._output(request, new_tokens, logprobs, prompt_logprobs, error))
            if finished:
                self.runner.release(rid)
        if self.offloader is not None:  # write-throughs of requests that just finished
            self.offloader.offload(self.kv_cache.take_offloads())
        return outputs

    # ---- structured output -------------------------------------------------------------------
    def _resolve_grammars(self) -> list[EngineCoreOutput]:
        """Build the matcher of every request whose grammar finished compiling; a request whose
        grammar failed finishes here with an error (the engine goes on)."""
        outputs = []
        for rid, request in list(self._compiling.items()):
            if not request.grammar.compiled():
                continue
            del self._compiling[rid]
            if not request.grammar.resolve():
                logger.info("request %s: grammar failed: %s", rid, request.grammar.error)
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                out = self._final(request)
                out.error = f"invalid grammar: {request.grammar.error}"
                outputs.append(out)
        return outputs

    def _advance_grammar(self, request: Request, token: int) -> None:
        """Feed the sampled token to the request's matcher; finish the request when the grammar
        is complete (no EOS step needed) or, should it ever reject a token, with an error."""
        grammar = request.grammar
        if not grammar.accept(token):
            logger.warning("request %s: grammar rejected token %d: %s", request.request_id, token, grammar.error)
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        elif grammar.is_terminated and token not in request.eos_token_ids:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def housekeeping(self) -> None:
        """Between steps while idle: release expired or deleted pins (their blocks become evictable)."""
        if self.kv_cache.expire_pins() and self.offloader is not None:
            self.offloader.offload(self.kv_cache.take_offloads())

    def _finish_loads(self) -> None:
        """Apply finished tier reads; wait a little for one when nothing else could run."""
        assert self.offloader is not None
        idle = not self.scheduler.running and not self.scheduler.waiting and self.scheduler.loading
        loading = self.scheduler.loading
        for request_id, num_blocks in self.offloader.poll(timeout=0.05 if idle else 0.0,
                                                         is_live=lambda rid: rid in loading):
            self.scheduler.finish_loading(request_id, num_blocks)

    # ---- offline convenience ----------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run ``prompts`` together to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            rid = self.add_request(prompt, p)
            req = self.scheduler.requests[rid]
            processor.add_request(rid, req.prompt_token_ids, req.sampling_params, req.arrival_time)
            results[rid] = GenerationResult(rid, list(req.prompt_token_ids), [], "", None, 0,
                                            [] if (p and p.logprobs is not None) else None)
            order.append(rid)
        while self.has_unfinished():
            outs, stopped = processor.process(self.step())
            for rid in stopped:  # a stop string ended it: free its blocks now
                self.abort(rid, stopped=True)
            for out in outs:
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.text
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
                    res.num_cache_write_tokens = out.num_cache_write_tokens
        return [results[rid] for rid in order]
