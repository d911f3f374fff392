"""A generation request as the scheduler sees it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvtypes.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # holds fresh blocks that a lower KV tier is filling; not runnable yet
    PREEMPTED = "preempted"  # lost its blocks; waits at the head of the queue to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason (``stop``, ``length``, ``abort``, ``error``) or None while live."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    """Token state of one sequence.

    Invariant: ``num_computed_tokens <= len(all_token_ids)``; the KV of the first
    ``num_computed_tokens`` tokens lives in the blocks the cache manager holds for it. A
    running request samples when a step brings ``num_computed_tokens`` up to
    ``len(all_token_ids)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: min(params.max_tokens, max_model_len - prompt length)
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None  # who sent it: admission is round-robin by tenant (None: no tenants)
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    first_scheduled_time: float | None = None
    # Structured output: the engine's per-request grammar (engine.sampling.structured_output.RequestGrammar).
    # While its compilation is pending (``ready()`` False) the scheduler leaves the request waiting.
    grammar: Any = None
    # The think block's state (engine.sampling.reasoning.ReasoningState) of a request with a reasoning
    # budget or a grammar on a reasoning model; None otherwise. Such a request does not speculate.
    reasoning: Any = None
    # Prompt logprobs collected so far (entry i: prompt token i+1 given the tokens before it),
    # filled by the runner when sampling_params.prompt_logprobs is set.
    prompt_logprobs: list[Any] = field(default_factory=list)
    num_tier_loaded_tokens: int = 0  # of the cached tokens, those loaded from a lower tier
    tier_sources: list[str] = field(default_factory=list)  # per block of its tier load: the tier that held it
    num_cache_write_tokens: int = 0  # tokens this request wrote into retained cache (pins, 24h retention)
    cache_policy_applied: bool = False  # pins / retention taken (when its prefill completed)
    # Speculative decoding, this request's share of SchedulerStats' spec counters: drafts verified,
    # their tokens, and of those the accepted ones.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The adaptive rule's estimate of the chance that a draft position is accepted (an exponentially
    # weighted mean over the positions observed, scheduler/speculative.py), and the first token of a
    # draft it proposed but did not verify, to be checked against the token plain decode samples.
    spec_acceptance: float = 0.5
    spec_shadow_token: int | None = None
    # Eviction inside the sequence (cache/eviction): whether the policy applies to it, its cap on
    # prompt + output (None: the scheduler's max_model_len) and the tokens its KV dropped so far.
    evicts: bool = False
    max_total_tokens: int | None = None
    num_evicted_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def is_blocked(self) -> bool:
        """Not schedulable yet: its grammar is still compiling."""
        return self.grammar is not None and not self.grammar.ready()

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and are not complete: every prompt position must run
        through the model (no prefix-cache hit may skip it)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
