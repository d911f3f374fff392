"""Tenant fairness and priority (scheduler/fairness.py): round-robin admission by tenant within a
priority, priority order of admission, and the lowest priority preempted under KV pressure."""
from __future__ import annotations

import pytest

from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.fairness import queue_position
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from cache import KVCacheManager
from tests.helpers import tiny_engine, tiny_hf_model
from tests.scheduler.test_scheduler import make_request, run_step


def _finish_order(tenants: bool) -> list[str]:
    """Tenant A queues 50 requests, then tenant B 2, on a real tiny engine (4 running at most);
    the request ids in the order they finish."""
    engine = tiny_engine(tiny_hf_model(), max_num_seqs=4, num_blocks=256)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for i in range(50):
        engine.add_request([5 + i % 50, 6, 7, 8, 9], params, f"A{i}", tenant="A" if tenants else None)
    for i in range(2):
        engine.add_request([60 + i, 6, 7, 8, 9], params, f"B{i}", tenant="B" if tenants else None)
    order = []
    while engine.has_unfinished():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_one_tenants_queue_does_not_starve_another():
    order = _finish_order(tenants=True)
    a_done_before_b = [r for r in order[:max(order.index("B0"), order.index("B1"))] if r.startswith("A")]
    assert len(a_done_before_b) <= 10, order  # B's two finish before A's last 40
    assert [r for r in order if r.startswith("A")] == [f"A{i}" for i in range(50)]  # A alone: arrival order


def test_without_tenants_the_queue_is_first_come_first_served():
    order = _finish_order(tenants=False)
    assert order[-2:] == ["B0", "B1"] or set(order[-2:]) == {"B0", "B1"}, order


def _req(rid: str, tenant: str | None, priority: int = 0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), 1, tenant=tenant, priority=priority)


@pytest.mark.parametrize("by_priority", [False, True])
def test_queue_position_alternates_tenants(by_priority):
    waiting: list[Request] = []
    for rid, tenant in [("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B"), ("c0", "C"), ("b1", "B"),
                        ("a3", "A")]:
        r = _req(rid, tenant)
        waiting.insert(queue_position(waiting, r, by_priority), r)
    assert [r.request_id for r in waiting] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_priority_orders_admission_and_tenants_alternate_within_a_priority():
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64, policy="priority"),
                  kv)
    for rid, tenant, priority in [("a-low", "A", 5), ("a0", "A", 0), ("a1", "A", 0), ("b-low", "B", 5),
                                  ("b0", "B", 0)]:
        s.add_request(_req(rid, tenant, priority))
    assert [r.request_id for r in s.waiting] == ["a0", "b0", "a1", "a-low", "b-low"]
    admitted = []
    while s.has_unfinished():
        out = run_step(s)
        admitted += [x.request.request_id for x in out.scheduled if x.request.request_id not in admitted]
    assert admitted == ["a0", "b0", "a1", "a-low", "b-low"]


@pytest.mark.parametrize("policy,victim", [("fcfs", "high"), ("priority", "low")])
def test_kv_pressure_preempts_the_lowest_priority(policy, victim):
    """8 blocks of 4 tokens cannot hold two requests of 10 + 20 tokens: when the pool runs out,
    fcfs preempts the most recently admitted (``high``, admitted second), the priority policy
    the lowest priority (``low``, admitted first), as vLLM's priority scheduling does."""
    kv = KVCacheManager(8, 4, True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, policy=policy), kv)
    low = make_request("low", 10, 20, seed=1)
    low.priority = 5
    s.add_request(low)
    run_step(s)
    high = make_request("high", 10, 20, seed=2)
    high.priority = 0
    s.add_request(high)
    preempted: list[str] = []
    steps = 0
    while s.has_unfinished():
        preempted += [r.request_id for r in run_step(s).preempted]
        steps += 1
        assert steps < 500
    assert preempted and preempted[0] == victim
    assert low.num_output_tokens == high.num_output_tokens == 20
