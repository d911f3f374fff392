"""Where a new request joins the waiting queue, and which running request yields under KV pressure.

Contract of the waiting order (``queue_position``):

* ``policy: priority``: lower ``Request.priority`` first (vLLM's sense); ``fcfs``: one class.
* Within a class, requests of different tenants alternate: a request whose tenant already has
  ``k`` requests waiting in its class joins after every request of the class whose own round
  (its position among its tenant's waiting requests of the class) is ``<= k``. So tenant A's 50
  queued requests take one turn each with tenant B's 2, not all before them; a tenant alone is
  served in arrival order.
* Requests without a tenant (``tenant is None``: the server runs without a key file) are
  appended at the end of their class: first come, first served, as before.

Requests that come back to the head of the queue (preempted ones, finished tier loads) keep
the head: the order above is where newcomers join, nothing re-sorts the queue.

Preemption (``preemption_victim``): under ``fcfs`` the most recently admitted running request
yields, as before; under ``priority`` the lowest-priority one (the largest ``priority``, the
latest arrival among equals), as vLLM's priority scheduling does, among the requests this step
has not scheduled yet.
"""
from __future__ import annotations

from typing import Sequence

from scheduler.request import Request


def queue_position(waiting: Sequence[Request], request: Request, by_priority: bool) -> int:
    """The index at which ``request`` joins ``waiting`` (see the module contract)."""
    klass = request.priority if by_priority else 0
    if request.tenant is None:
        if not by_priority:
            return len(waiting)
        # Stable insert: after every request of higher or equal priority.
        return next((i for i, r in enumerate(waiting) if r.priority > klass), len(waiting))
    own = sum(1 for r in waiting if r.tenant == request.tenant and (not by_priority or r.priority == klass))
    rounds: dict[str | None, int] = {}
    for i, r in enumerate(waiting):
        r_class = r.priority if by_priority else 0
        if r_class < klass:
            continue
        if r_class > klass:
            return i
        turn = rounds.get(r.tenant, 0)
        rounds[r.tenant] = turn + 1
        if turn > own:
            return i
    return len(waiting)


def preemption_victim(running: Sequence[Request], first: int, by_priority: bool) -> int:
    """The index in ``running`` of the request to preempt, chosen among ``running[first:]``
    (those this step has not scheduled yet; ``first`` is the one asking for blocks)."""
    if not by_priority:
        return len(running) - 1
    return max(range(first, len(running)), key=lambda i: (running[i].priority, running[i].arrival_time))
