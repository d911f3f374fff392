"""What the engine reports per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """The new tokens and text of one request since its previous output.

    ``text`` is safe to send as is: complete characters only, stop strings removed.
    ``finish_reason`` is ``stop`` | ``length`` | ``abort`` | ``error`` on the last output.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0  # tokens written into retained cache (pins, 24h retention)
    num_evicted_tokens: int = 0  # tokens whose KV the eviction policy dropped so far (cache/eviction)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    arrival_time: float | None = None  # time.monotonic() when the request arrived
    first_scheduled_time: float | None = None  # when it was first admitted to the running batch
    # On the first output of a request that asked for prompt logprobs: one entry per prompt
    # token from the second on (the first has no context to be predicted from).
    prompt_logprobs: list[TokenLogprob] | None = None
