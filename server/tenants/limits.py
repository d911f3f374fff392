"""Per-tenant admission: concurrency slots, a queue for them, and a tokens-per-minute bucket.

Contract:

* A request is admitted (``TenantLimiter.admit``) once, before its engine requests start, and
  holds its ``Lease`` until its response ends (``Lease.release``, idempotent; a lease dropped
  unreleased releases itself). One HTTP request takes one slot whatever its ``n``.
* ``max_concurrent_requests``: leases held at once. Over it, the request waits for a slot if
  fewer than ``max_queued_requests`` already wait, else it is refused (``RateLimited``).
  Waiters get slots in arrival order.
* ``tokens_per_minute``: a token bucket of that capacity refilling at capacity / 60 per second
  (starting full). A request's tokens are not known before it runs, so admission charges the
  most it can use, its prompt tokens plus ``max_tokens`` (the room left in the context when
  it sets none), and the release refunds what it did not use (its prompt plus the tokens it
  generated is what it is finally charged). A request whose charge the bucket cannot cover now
  is refused with the seconds until it could; one larger than the whole bucket can never run
  (``TooLarge``).
* State is kept per tenant name, so a reloaded key file keeps the counts of requests in flight;
  one tenant's state never refuses another's request.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from server.tenants.config import Tenant

Clock = Callable[[], float]


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s, self.reason = retry_after_s, reason  # reason: concurrency | queue | tokens


class TooLarge(Exception):
    """The request may use more tokens than the tenant's bucket holds at all."""


class TokenBucket:
    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.clock = clock
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def resize(self, per_minute: int) -> None:
        self._refill()
        self.capacity = float(per_minute)
        self.level = min(self.level, self.capacity)

    def take(self, tokens: int) -> float:
        """Take ``tokens`` and return 0, or take nothing and return the seconds until they are there."""
        self._refill()
        if tokens <= self.level:
            self.level -= tokens
            return 0.0
        return (tokens - self.level) * 60.0 / self.capacity

    def refund(self, tokens: int) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + tokens)


@dataclass
class _TenantState:
    active: int = 0
    waiters: deque = field(default_factory=deque)  # futures of requests waiting for a slot
    bucket: TokenBucket | None = None


class Lease:
    """One admitted request's slot and token charge."""

    def __init__(self, limiter: "TenantLimiter | None", tenant: Tenant, charged: int, slot: bool) -> None:
        self.limiter, self.tenant, self.charged, self.slot = limiter, tenant, charged, slot
        self.released = False

    def release(self, used_tokens: int | None = None) -> None:
        """Give the slot back and refund ``charged - used_tokens`` (None: refund nothing)."""
        if self.released:
            return
        self.released = True
        if self.limiter is not None:
            self.limiter._release(self, used_tokens)

    def __del__(self) -> None:  # a response that never ran (its client left before the stream began)
        if not self.released:
            self.release(0)


class TenantLimiter:
    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            state = self._states[tenant.name] = _TenantState()
        if tenant.tokens_per_minute is None:
            state.bucket = None
        elif state.bucket is None:
            state.bucket = TokenBucket(tenant.tokens_per_minute, self.clock)
        elif state.bucket.capacity != tenant.tokens_per_minute:
            state.bucket.resize(tenant.tokens_per_minute)
        return state

    def limited(self, tenant: Tenant) -> bool:
        return tenant.max_concurrent_requests is not None or tenant.tokens_per_minute is not None

    async def admit(self, tenant: Tenant, max_tokens: int) -> Lease:
        """A lease for one request that may use up to ``max_tokens`` (prompt + output); raises
        ``RateLimited`` or ``TooLarge`` (nothing is held then)."""
        if not self.limited(tenant):
            return Lease(None, tenant, 0, False)
        state = self._state(tenant)
        charged = 0
        if state.bucket is not None:
            if max_tokens > state.bucket.capacity:
                raise TooLarge(f"this request may use up to {max_tokens} tokens (prompt + max_tokens), more than "
                               f"this API key's tokens_per_minute ({tenant.tokens_per_minute})")
            wait = state.bucket.take(max_tokens)
            if wait > 0:
                raise RateLimited(f"this API key is over its tokens_per_minute ({tenant.tokens_per_minute}); "
                                  f"retry in {math.ceil(wait)} s", max(1, math.ceil(wait)), "tokens")
            charged = max_tokens
        lease = Lease(self, tenant, charged, slot=False)
        limit = tenant.max_concurrent_requests
        if limit is None:
            return lease
        if state.active < limit and not state.waiters:
            state.active += 1
            lease.slot = True
            return lease
        if len(state.waiters) >= tenant.max_queued_requests:
            lease.release(0)
            reason = "concurrency" if tenant.max_queued_requests == 0 else "queue"
            raise RateLimited(f"this API key has {state.active} requests in flight, its max_concurrent_requests "
                              f"({limit})" + (f", and {len(state.waiters)} waiting, its max_queued_requests"
                                               if tenant.max_queued_requests else "") + "; retry later", 1, reason)
        future = asyncio.get_running_loop().create_future()
        state.waiters.append(future)
        try:
            await future  # the releasing request hands its slot over (active stays counted)
        except BaseException:
            if future in state.waiters:
                state.waiters.remove(future)
            else:  # a slot was handed over just as this waiter left: give it on
                state.active -= 1
                self._hand_over(state)
            lease.release(0)
            raise
        lease.slot = True
        return lease

    def _hand_over(self, state: _TenantState) -> None:
        while state.waiters:
            future = state.waiters.popleft()
            if not future.done():
                state.active += 1
                loop = future.get_loop()
                try:
                    here = asyncio.get_running_loop() is loop
                except RuntimeError:
                    here = False
                if here:
                    future.set_result(None)
                else:  # a lease collected on another thread: wake the waiter on its own loop
                    loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
                return

    def _release(self, lease: Lease, used_tokens: int | None) -> None:
        state = self._states.get(lease.tenant.name)
        if state is None:
            return
        if lease.charged and state.bucket is not None and used_tokens is not None:
            state.bucket.refund(max(0, lease.charged - used_tokens))
        if lease.slot:
            state.active -= 1
            self._hand_over(state)

    def in_flight(self, name: str) -> int:
        state = self._states.get(name)
        return state.active if state is not None else 0
