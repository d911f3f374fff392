"""Continuous batching under one token budget.

Each ``schedule()`` call plans one engine step:

1. Running requests first, in admission order: one decode token each, or the next chunk of
   an unfinished prefill, cut to the remaining budget. When the pool cannot supply a
   block, the most recently admitted running request is preempted (under ``policy: priority``
   the lowest-priority one: scheduler/fairness.py; its blocks go back to the pool, full ones
   stay in the prefix cache, so recomputing it later is mostly a hit).
   With ``speculative_config`` a decoding request that may speculate (scheduler/speculative.py)
   runs its last token plus a draft (scheduler/drafting: n-gram or suffix) instead, when the adaptive rule
   (``speculative.choose_speculators``) says the verify step pays; the budget counts every draft
   token, and when the pool cannot hold the draft it decodes one token as usual.
2. Then, only if nobody was preempted this step, waiting requests in queue order (newcomers
   join it round-robin by tenant within a priority: scheduler/fairness.py): a
   prefix-cache lookup, then a prefill chunk of what is not cached. When the hash chain
   continues in a lower KV tier (disk), the request instead takes fresh blocks for those
   blocks and moves to ``loading`` (``SchedulerOutput.loads``); the engine fills the blocks
   off the step and calls ``finish_loading``, which puts it back at the head of the queue.
   Only that request waits for its blocks, never the batch.

Pins (``cache_control``) and expiries are applied at the start of each plan; when memory
pressure cannot be relieved by preemption, pins are demoted before a request would starve.

``update()`` applies the sampled tokens (for a draft: the accepted run, its rejected slots
rolled back) and finishes requests on EOS, stop token ids, ``max_tokens`` or the context
length. Every finish path (including ``abort``) frees the request's blocks immediately.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from cache import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.fairness import preemption_victim, queue_position
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.drafting import Drafter, build_drafter
from scheduler.speculative import can_speculate, check_run, choose_speculators, observe_acceptance


@dataclass
class SchedulerStats:
    """Monotonic counters for metrics; the gauges are read off the scheduler directly."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of which found in the cache
    num_preemptions: int = 0
    tier_queries: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})  # tokens looked up
    tier_hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})  # tokens found
    # Speculative decoding: drafts verified, their tokens, and of those the accepted ones.
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, verify_row_budget: int | None = None) -> None:
        """``verify_row_budget``: the most rows (decode tokens plus draft tokens) a step may have
        for the engine to verify drafts on its fast path (``choose_speculators``); None: no limit."""
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be resolved before building a Scheduler")
        self.config = config
        self.verify_row_budget = verify_row_budget
        self.max_model_len: int = config.max_model_len
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # waiting on their lower-tier blocks
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.new_token_ids: dict[str, list[int]] = {}  # of the latest update(): request id -> its tokens
        self._drafter: tuple[object, Drafter] | None = None  # (the speculative config it was built for, it)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        index = queue_position(self.waiting, request, self.config.policy == "priority")
        if index == len(self.waiting):
            self.waiting.append(request)
        else:
            self.waiting.insert(index, request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish live requests (abort, stop string, error); unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request.request_id in self.loading:
                del self.loading[request.request_id]
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def abort(self, request_id: str) -> bool:
        return bool(self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        completed = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if completed:
            self._retain(request)
        if self._drafter is not None and self._drafter[0] is self.config.speculative_config:
            self._drafter[1].finish(request, completed)  # a request run with speculation off teaches it nothing
        self.kv_cache.free(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _retain(self, request: Request) -> None:
        """Apply the request's cache policy (pins, 24h retention) while it holds its blocks: once,
        when its prefill completes (a preempted request that recomputes does not apply it again)."""
        policy = request.sampling_params.cache_policy
        if policy is None or request.cache_policy_applied:
            return
        request.cache_policy_applied = True
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        written = 0
        if policy.pin_tokens:
            written += self.kv_cache.pin_request(request.request_id, min(policy.pin_tokens, computed),
                                                 policy.pin_ttl_s, request.cache_salt, request.tenant)
        if policy.retention_s is not None:
            written += self.kv_cache.retain_request(request.request_id, computed,
                                                    self.kv_cache.wall_clock() + policy.retention_s)
        request.num_cache_write_tokens = written

    def finish_loading(self, request_id: str, num_loaded_blocks: int) -> bool:
        """The engine filled the first ``num_loaded_blocks`` tier blocks of a loading request:
        it becomes waiting again, at the head of the queue. False if it is no longer loading."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache.finish_load(request_id, num_loaded_blocks)
        loaded = num_loaded_blocks * self.kv_cache.block_size
        request.num_computed_tokens += loaded
        request.num_tier_loaded_tokens += loaded
        if request.num_computed_tokens == 0:  # nothing usable arrived: start over without blocks
            self.kv_cache.free(request_id)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        return True

    def _relieve_pressure(self, keep: Request) -> bool:
        """No preemption can help: demote a pin, else take the blocks of a waiting request that
        holds some (it recomputes, mostly from the prefix cache). False if nothing was freed."""
        if self.kv_cache.demote_oldest_pin():
            return True
        for request in self.waiting:
            if request is not keep and request.num_computed_tokens > 0:
                self.kv_cache.free(request.request_id)
                request.num_computed_tokens = 0
                request.num_tier_loaded_tokens = 0
                request.tier_sources = []
                return True
        return False

    # ---- planning -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.kv_cache.expire_pins()

        drafts = self._plan_drafts()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            draft = drafts.get(request.request_id, [])[:budget - 1] if num_new == 1 else []
            if draft and self.kv_cache.allocate_slots(request, 1 + len(draft)) is not None:
                out.scheduled.append(ScheduledRequest(request, 1 + len(draft),
                                                      self.kv_cache.get_block_ids(request.request_id), draft))
                budget -= 1 + len(draft)
                index += 1
                continue
            while self.kv_cache.allocate_slots(request, num_new) is None:
                at = preemption_victim(self.running, index, self.config.policy == "priority")
                if self.running[at] is request and self._relieve_pressure(request):
                    continue
                victim = self.running.pop(at)  # never one already scheduled (scheduler/fairness.py)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1

        blocked: list[Request] = []  # skipped this step (grammar compiling), put back in order
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.is_blocked:
                blocked.append(self.waiting.popleft())
                continue
            if request.num_computed_tokens > 0:  # came back from a tier load holding its blocks
                cached_blocks, num_cached = [], request.num_computed_tokens
            elif request.wants_prompt_logits:  # every prompt position's logits are needed
                cached_blocks, num_cached = [], 0
            else:
                cached_blocks, num_cached = self.kv_cache.get_computed_blocks(request.all_token_ids,
                                                                              request.cache_salt)
                tier_hashes = self.kv_cache.get_tier_hits(request.all_token_ids, request.cache_salt, cached_blocks)
                if tier_hashes:
                    fresh = self.kv_cache.allocate_for_load(request, cached_blocks, tier_hashes)
                    if fresh is None:
                        if not self.running and self._relieve_pressure(request):
                            continue
                        break
                    self.waiting.popleft()
                    request.num_computed_tokens = num_cached
                    request.status = RequestStatus.LOADING
                    request.tier_sources = self.kv_cache.tier_sources(tier_hashes)
                    self.loading[request.request_id] = request
                    out.loads.append((request, [(b.block_id, h) for b, h in zip(fresh, tier_hashes)]))
                    continue
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv_cache.allocate_slots(request, num_new, cached_blocks) is None:
                if not self.running and not out.scheduled and self._relieve_pressure(request):
                    continue
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:  # first admission; re-admission after preemption is not a query
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                self.stats.prefix_cache_queries += request.num_tokens
                self.stats.prefix_cache_hits += num_cached
                device_hits = num_cached - request.num_tier_loaded_tokens
                self.stats.tier_queries["device"] += request.num_tokens
                self.stats.tier_hits["device"] += device_hits
                if self.kv_cache.tier is not None:  # each lower tier sees what the ones above did not hold
                    remaining = request.num_tokens - device_hits
                    loaded = request.tier_sources[:request.num_tier_loaded_tokens // self.kv_cache.block_size]
                    for name in self.kv_cache.tier_names():
                        found = loaded.count(name) * self.kv_cache.block_size
                        self.stats.tier_queries[name] = self.stats.tier_queries.get(name, 0) + remaining
                        self.stats.tier_hits[name] = self.stats.tier_hits.get(name, 0) + found
                        remaining -= found
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(blocked))
        out.rope_shifts = self.kv_cache.take_rope_shifts()
        return out

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """The request's run this step, with where its evicted KV leaves its new tokens (cache/eviction)."""
        evicted, shift = self.kv_cache.sequence_offsets(request.request_id)
        request.num_evicted_tokens = evicted
        return ScheduledRequest(request, num_new, self.kv_cache.get_block_ids(request.request_id),
                                num_evicted_tokens=evicted, position_shift=shift)

    def _plan_drafts(self) -> dict[str, list[int]]:
        """This step's drafts by request id: every decoding request that may speculate proposes
        one, and the adaptive rule (``choose_speculators``) keeps those that pay. A proposal not
        kept leaves its first token as the request's shadow draft: the token plain decode samples
        next tells whether it would have been accepted, so the estimate keeps learning while the
        request does not speculate. Drafts are cut to the budget when scheduled."""
        spec = self.config.speculative_config
        if spec is None:
            return {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if spec.disable_by_batch_size is not None and len(decoding) > spec.disable_by_batch_size:
            # nobody may draft: skip the proposals (a lookup per request per step) and the shadows
            for request in decoding:
                request.spec_shadow_token = None
            return {}
        proposals: dict[str, list[int]] = {}
        candidates = []
        for request in decoding:
            request.spec_shadow_token = None
            draft = self._propose(request)
            if draft:
                proposals[request.request_id] = draft
                candidates.append((request, len(draft)))
        chosen = choose_speculators(candidates, len(decoding), spec, self.verify_row_budget)
        for request, _ in candidates:
            if request.request_id not in chosen:
                request.spec_shadow_token = proposals.pop(request.request_id)[0]
        return proposals

    def drafter(self) -> Drafter | None:
        """The drafter of the current ``speculative_config`` (rebuilt when the config changes)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self._drafter is None or self._drafter[0] is not spec:
            self._drafter = (spec, build_drafter(spec))
        return self._drafter[1]

    def _propose(self, request: Request) -> list[int]:
        """The draft of a decoding request ([] when it may not speculate): no more than
        ``max_tokens`` and the context length leave room for."""
        spec = self.config.speculative_config
        if not can_speculate(request):
            return []
        room = min(spec.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        if room < 1:
            return []
        return self.drafter().propose(request, room)

    # ---- applying a step's results ------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what is done.

        ``sampled`` maps request id -> token for every scheduled request with ``samples``;
        ``verified`` maps each request that ran a draft to the run its verification emitted: the
        accepted draft tokens, then the model's token after them (``_apply_draft``). Returns the
        requests that received tokens this step (finished ones included); ``new_token_ids`` says which.
        """
        touched = []
        self.new_token_ids = {}
        for item in out.scheduled:
            request = item.request
            if request.status.is_finished:
                continue
            if item.draft_token_ids:
                self._apply_draft(item, (verified or {})[request.request_id])
                touched.append(request)
                continue
            prefilling = request.num_computed_tokens < request.num_prompt_tokens
            request.num_computed_tokens += item.num_new_tokens
            if prefilling and request.num_computed_tokens >= request.num_prompt_tokens:
                self._retain(request)  # pins and retention as soon as the prompt's KV exists
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing to sample yet
            token = sampled[request.request_id]
            if request.spec_shadow_token is not None:  # would its draft's first token have been accepted?
                request.spec_acceptance = observe_acceptance(request.spec_acceptance,
                                                             int(token == request.spec_shadow_token), 1)
                request.spec_shadow_token = None
            request.append_output_token(token)
            touched.append(request)
            self.new_token_ids[request.request_id] = [token]
            status = self._stop_status(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
        return touched

    def _apply_draft(self, item: ScheduledRequest, accepted: list[int]) -> None:
        """Append the accepted run (up to its first stop), roll the rest back.

        The step computed K/V for the last known token and every draft token; of those, the
        last known token and the accepted draft tokens are now known tokens with valid K/V, so
        ``num_computed_tokens`` ends one short of ``num_tokens`` as after a plain decode, and
        the blocks past it, holding only rejected slots, go back to the pool. Drafts never
        enter ``all_token_ids`` before acceptance, so no hashed block holds a rejected token.
        """
        request = item.request
        check_run(item.draft_token_ids, accepted)
        self.stats.spec_num_drafts += 1
        self.stats.spec_draft_tokens += len(item.draft_token_ids)
        self.stats.spec_accepted_tokens += len(accepted) - 1
        request.spec_num_drafts += 1
        request.spec_num_draft_tokens += len(item.draft_token_ids)
        request.spec_num_accepted_tokens += len(accepted) - 1
        request.spec_acceptance = observe_acceptance(request.spec_acceptance, len(accepted) - 1,
                                                     len(item.draft_token_ids))
        per_pos = self.stats.spec_accepted_per_pos
        per_pos.extend([0] * (len(accepted) - 1 - len(per_pos)))
        for i in range(len(accepted) - 1):
            per_pos[i] += 1
        appended: list[int] = []
        status = None
        for token in accepted:
            request.append_output_token(token)
            appended.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                break
        self.new_token_ids[request.request_id] = appended
        request.num_computed_tokens = request.num_tokens - 1
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
        else:
            self.kv_cache.truncate(request.request_id, request.num_computed_tokens)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        limit = request.max_total_tokens or self.max_model_len  # evicting requests: their own cap
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= limit:
            return RequestStatus.FINISHED_LENGTH
        return None
