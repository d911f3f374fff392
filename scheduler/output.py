"""The plan of one engine step."""
from __future__ import annotations

from dataclasses import dataclass, field

from cache.eviction import RopeShift
from cache.hashing import BlockHash
from scheduler.request import Request


@dataclass
class ScheduledRequest:
    """Run ``num_new_tokens`` tokens of ``request`` starting at ``request.num_computed_tokens``.

    With ``draft_token_ids`` (speculative decoding) the run is the request's last known token
    followed by the draft: ``num_new_tokens == 1 + len(draft_token_ids)``, slots allocated for
    all of them, and the step returns the model's token after each of them for verification.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    # Eviction inside the sequence (cache/eviction): its new token at text position t goes to
    # cache slot t - num_evicted_tokens of block_ids and is rotated at position t - position_shift.
    num_evicted_tokens: int = 0
    position_shift: int = 0

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so the next token is sampled."""
        return (self.request.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
                == self.request.num_tokens)

    def input_token_ids(self) -> list[int]:
        """The tokens this step runs: known tokens from ``num_computed_tokens`` on, then the draft."""
        start = self.request.num_computed_tokens
        known = self.request.all_token_ids[start:start + self.num_new_tokens - len(self.draft_token_ids)]
        return known + self.draft_token_ids if self.draft_token_ids else known


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that began loading their prefix from the lower tier: (request, [(block id, hash)]).
    loads: list[tuple[Request, list[tuple[int, BlockHash]]]] = field(default_factory=list)
    # Re-rotations of kept keys (and their copies on write) to apply before the forward pass.
    rope_shifts: list[RopeShift] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
