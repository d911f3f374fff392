"""The plan of one engine step."""
from __future__ import annotations

from dataclasses import dataclass, field

from cache.hashing import BlockHash
from scheduler.request import Request


@dataclass
class ScheduledRequest:
    """Run ``num_new_tokens`` tokens of ``request`` starting at ``request.num_computed_tokens``."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so the next token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that began loading their prefix from the lower tier: (request, [(block id, hash)]).
    loads: list[tuple[Request, list[tuple[int, BlockHash]]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
