"""Scheduler behaviour with a fake model: no torch, exact accounting of blocks and budgets."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import KVCacheManager
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

EOS = 2


def fake_tokens(out: SchedulerOutput) -> dict[str, int]:
    """A deterministic 'model': the next token is a function of the sequence so far (never EOS)."""
    return {s.request.request_id: 3 + sum(s.request.all_token_ids) % 97
            for s in out.scheduled if s.samples}


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=256,
                   prefix_caching=True, chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, kv)


def make_request(rid: str, prompt_len: int, max_tokens: int, seed: int = 0, **params) -> Request:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 100) for _ in range(prompt_len)]
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                   max_tokens=max_tokens, eos_token_ids=frozenset([EOS]))


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    assert len({x.request.request_id for x in out.scheduled}) == len(out.scheduled)
    s.update(out, fake_tokens(out))
    s.kv_cache.check_invariants()
    return out


def assert_empty(s: Scheduler) -> None:
    assert not s.has_unfinished()
    assert s.kv_cache.usage == 0
    assert s.kv_cache.num_free_blocks == s.kv_cache.block_pool.num_blocks


def test_single_request_runs_to_max_tokens():
    s = make_scheduler()
    r = make_request("a", 10, 5)
    s.add_request(r)
    first = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in first.scheduled] == [("a", 10)]
    steps = 1
    while s.has_unfinished():
        out = run_step(s)
        assert [x.num_new_tokens for x in out.scheduled] == [1]
        steps += 1
    assert steps == 5 and r.num_output_tokens == 5
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert_empty(s)


def test_stop_conditions():
    s = make_scheduler()
    eos = make_request("eos", 4, 10)
    stop_id = make_request("stopid", 4, 10, stop_token_ids=[50])
    min_tok = make_request("min", 4, 10, min_tokens=3)
    for r in (eos, stop_id, min_tok):
        s.add_request(r)
    out = s.schedule()
    s.update(out, {"eos": EOS, "stopid": 50, "min": EOS})
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS]
    assert stop_id.status is RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 50
    assert min_tok.status is RequestStatus.RUNNING  # EOS ignored before min_tokens
    ctx = make_scheduler(max_model_len=8)
    r = make_request("ctx", 6, 100)
    ctx.add_request(r)
    while ctx.has_unfinished():
        run_step(ctx)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_long_prompt_is_chunked_while_decodes_continue():
    s = make_scheduler(budget=16, num_blocks=128)
    short = make_request("short", 4, 40)
    s.add_request(short)
    run_step(s)  # short prefilled
    long = make_request("long", 100, 2, seed=1)
    s.add_request(long)
    chunks = []
    while long.num_computed_tokens < 100:
        out = run_step(s)
        by_id = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
        assert by_id["short"] == 1  # the decode is never stalled by the long prefill
        chunks.append(by_id.get("long", 0))
    assert chunks == [15] * 6 + [10]
    assert long.num_output_tokens == 1  # sampled exactly when the last chunk completed


def test_max_num_seqs_and_fcfs_admission():
    s = make_scheduler(max_seqs=2, budget=64)
    reqs = [make_request(f"r{i}", 5, 3, seed=i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    while s.has_unfinished():
        run_step(s)
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert_empty(s)


def test_prefix_hit_counted_once_and_skips_cached_blocks():
    s = make_scheduler(block_size=4)
    a = make_request("a", 13, 2, seed=5)
    s.add_request(a)
    while s.has_unfinished():
        run_step(s)
    b = make_request("b", 13, 2, seed=5)  # same prompt
    s.add_request(b)
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 1  # 12 tokens (3 blocks) cached, the last one recomputed
    assert b.num_cached_tokens == 12
    assert s.stats.prefix_cache_queries == 26 and s.stats.prefix_cache_hits == 12


def test_preemption_under_tiny_pool_and_resumption():
    # 8 blocks of 4 tokens: three requests of 10 prompt + 12 output tokens cannot all fit.
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    reqs = [make_request(f"p{i}", 10, 12, seed=i) for i in range(3)]
    alone = []
    for i in range(3):  # reference: each run alone on a big pool
        ref = make_scheduler(num_blocks=64)
        r = make_request(f"p{i}", 10, 12, seed=i)
        ref.add_request(r)
        while ref.has_unfinished():
            run_step(ref)
        alone.append(r.output_token_ids)
    for r in reqs:
        s.add_request(r)
    preempted = 0
    steps = 0
    while s.has_unfinished():
        out = run_step(s)
        preempted += len(out.preempted)
        if out.preempted:
            assert not any(x.request.num_computed_tokens == 0 and x.request.status is RequestStatus.RUNNING
                           and x.request in out.preempted for x in out.scheduled)
        steps += 1
        assert steps < 500
    assert preempted > 0 and s.stats.num_preemptions == preempted
    assert [r.output_token_ids for r in reqs] == alone
    assert_empty(s)


@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "decoding", "preempted"])
def test_abort_at_every_stage_frees_everything(stage):
    s = make_scheduler(num_blocks=8, block_size=4, budget=8)
    victim = make_request("v", 20, 20, seed=1)
    other = make_request("o", 10, 20, seed=2)
    if stage == "preempted":
        s.add_request(other)
        s.add_request(victim)
        while victim.status is not RequestStatus.PREEMPTED:
            run_step(s)
            assert s.has_unfinished()
    else:
        s.add_request(victim)
        if stage == "mid_prefill":
            run_step(s)
            assert 0 < victim.num_computed_tokens < 20
        elif stage == "decoding":
            while victim.num_output_tokens < 2:
                run_step(s)
    assert s.abort("v")
    assert victim.status is RequestStatus.FINISHED_ABORTED
    assert s.kv_cache.get_block_ids("v") == []
    assert not s.abort("v")  # idempotent
    s.kv_cache.check_invariants()
    while s.has_unfinished():
        run_step(s)
    assert_empty(s)


def test_no_starvation_under_steady_random_stream():
    rng = random.Random(7)
    s = make_scheduler(num_blocks=48, block_size=4, budget=24, max_seqs=6)
    pending = [make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 20), seed=i) for i in range(60)]
    live: list[Request] = []
    step = 0
    while pending or s.has_unfinished():
        if pending and rng.random() < 0.5:
            r = pending.pop(0)
            s.add_request(r)
            live.append(r)
        run_step(s)
        step += 1
        assert step < 5000
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens for r in live)
    assert_empty(s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_leave_nothing_behind(data):
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = data.draw(st.integers(12, 40))
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=data.draw(st.integers(4, 48)),
                       max_seqs=data.draw(st.integers(1, 8)), prefix_caching=data.draw(st.booleans()))
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    ops = data.draw(st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 10**6)),
                             min_size=1, max_size=60))
    n = 0
    for op, x in ops:
        if op == "add":
            plen = 1 + x % 20
            max_tokens = 1 + x % 7
            if -(-(plen + max_tokens) // block_size) > num_blocks:
                continue
            prompt = (shared + [3 + (x >> k) % 90 for k in range(plen)])[:plen] if x % 2 else \
                [3 + (x >> k) % 90 for k in range(plen)]
            s.add_request(Request(f"r{n}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                  max_tokens, frozenset([EOS])))
            n += 1
        elif op == "abort" and n:
            s.abort(f"r{x % n}")
        else:
            run_step(s)
        s.kv_cache.check_invariants()
    steps = 0
    while s.has_unfinished():
        run_step(s)
        steps += 1
        assert steps < 2000
    assert_empty(s)
