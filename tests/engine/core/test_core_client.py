"""The engine core loop and its asyncio client, in-process (the thread implementation of EngineClient).

The process implementation runs the same ``EngineCore.run`` loop and the same client half; it is
exercised over HTTP in tests/server (the session server and tests/server/test_core_faults.py).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from engine.core.client import EngineDeadError, InprocEngineClient as AsyncEngine
from engine.core.protocol import GENERIC_ENGINE_ERROR
from engine.llm_engine import FAULT_TOKEN_ENV
from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


@pytest.fixture
def async_engine(hf_model):
    engine = AsyncEngine(tiny_engine(hf_model, num_blocks=1024, max_num_batched_tokens=256, max_num_seqs=64))
    engine.start()
    yield engine
    engine.shutdown()


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 128) for _ in range(rng.randint(5, 60))]


async def collect(engine: AsyncEngine, ids, params, rid=None):
    tokens = []
    last = None
    async for out in engine.generate(ids, params, request_id=rid):
        tokens += out.new_token_ids
        last = out
    return tokens, last


def test_64_concurrent_generates_complete(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, prompt(i), params) for i in range(64)))

    results = asyncio.run(main())
    assert all(len(tokens) == 20 and last.finished and last.finish_reason == "length" for tokens, last in results)
    assert async_engine.stats.kv_used_blocks == 0 and async_engine.stats.num_running == 0
    assert async_engine.num_in_flight == 0


def test_cancelling_half_frees_their_blocks_within_one_step(async_engine):
    live_after_step: list[set[str]] = []
    class Recorder:
        def on_step(self, stats, outputs):  # in the loop thread: the engine may be read here
            if stats is not None and stats.num_batched_tokens:
                live_after_step.append(set(async_engine.engine.scheduler.requests))

    async_engine.observer = Recorder()
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        started = {i: asyncio.Event() for i in range(64)}

        async def run(i):
            tokens = 0
            async for out in async_engine.generate(prompt(i), params, request_id=f"r{i}"):
                tokens += len(out.new_token_ids)
                if tokens >= 3:
                    started[i].set()
            return tokens

        tasks = [asyncio.create_task(run(i)) for i in range(64)]
        await asyncio.gather(*(started[i].wait() for i in range(0, 64, 2)))
        for i in range(0, 64, 2):
            tasks[i].cancel()
        # A cancelled stream sends its abort as it unwinds; on a busy machine the engine may
        # run steps before the event loop gets there, so "one step" counts from the aborts.
        await asyncio.wait([tasks[i] for i in range(0, 64, 2)])
        steps_at_abort = len(live_after_step)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return steps_at_abort, results

    steps_at_abort, results = asyncio.run(main())
    cancelled = {f"r{i}" for i in range(0, 64, 2)}
    # The step running when the aborts were sent may finish with them; the next one must not hold them.
    assert not (live_after_step[steps_at_abort + 1] & cancelled)
    assert all(isinstance(results[i], asyncio.CancelledError) for i in range(0, 64, 2))
    assert all(results[i] == 60 for i in range(1, 64, 2))
    assert async_engine.stats.kv_used_blocks == 0
    async_engine.shutdown()
    async_engine.engine.kv_cache.check_invariants()


def test_event_loop_stays_responsive_under_full_load(async_engine):
    """The loop never waits for a model step: its lag stays well below one step's duration.

    On an idle machine that means under 50 ms. A busy machine (another process on one of the
    two cores) stretches both the steps and the OS's wake-ups, so the bound is also set
    relative to the step time measured in the same run: a loop that waited for steps would
    lag by whole steps.
    """
    import time

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    step_ends: list[float] = []

    class StepClock:
        def on_step(self, stats, outputs):
            if stats is not None and stats.num_batched_tokens:
                step_ends.append(time.monotonic())

    async_engine.observer = StepClock()

    async def main():
        load = asyncio.gather(*(collect(async_engine, prompt(i), params) for i in range(64)))
        loop = asyncio.get_running_loop()
        lags = []
        while not load.done():
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t0 - 0.005)
        await load
        return lags

    lags = asyncio.run(main())
    steps = sorted(b - a for a, b in zip(step_ends, step_ends[1:]))
    assert len(lags) > 10 and len(steps) >= 40
    median_step = steps[len(steps) // 2]
    assert max(lags) < max(0.05, 0.5 * median_step), (max(lags), median_step)


def test_step_failures_fail_their_requests_only_and_the_engine_serves_on(async_engine, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    real_execute = async_engine.engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("simulated device fault /secret/path")
        return real_execute(plan)

    monkeypatch.setattr(async_engine.engine.runner, "execute", flaky)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(collect(async_engine, prompt(i), params) for i in range(8))), timeout=30)

    results = asyncio.run(main())
    # Every request of the failing step fails (each also fails alone), with the generic message.
    assert all(last.finish_reason == "error" and last.error == GENERIC_ENGINE_ERROR for _, last in results)
    assert async_engine.is_healthy and async_engine.stats.kv_used_blocks == 0
    monkeypatch.setattr(async_engine.engine.runner, "execute", real_execute)
    tokens, last = asyncio.run(collect(async_engine, prompt(0), SamplingParams(temperature=0.0, max_tokens=5,
                                                                                  ignore_eos=True)))
    assert len(tokens) == 5 and last.finish_reason == "length"


def test_a_faulty_request_fails_alone(hf_model, monkeypatch):
    """The fault hook makes every step that holds the marked request raise: it fails, the others
    (batched in the same steps) finish with the tokens they get when run without it."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(i) for i in range(8)]

    def run(with_fault: bool):
        monkeypatch.setenv(FAULT_TOKEN_ENV, "127")
        client = AsyncEngine(tiny_engine(hf_model, num_blocks=512, max_num_batched_tokens=256, max_num_seqs=64))
        client.start()

        async def main():
            jobs = [collect(client, p, params) for p in prompts]
            if with_fault:
                jobs.append(collect(client, [127, 5, 6, 7], params))
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

        try:
            return asyncio.run(main()), client.stats
        finally:
            client.shutdown()

    alone, _ = run(False)
    together, stats = run(True)
    assert together[-1][1].finish_reason == "error" and together[-1][1].error == GENERIC_ENGINE_ERROR
    assert [t for t, _ in together[:-1]] == [t for t, _ in alone]
    assert all(last.finish_reason == "length" for _, last in together[:-1])
    assert stats.kv_used_blocks == 0


def test_generate_after_shutdown_raises(hf_model):
    client = AsyncEngine(tiny_engine(hf_model))
    client.start()
    client.shutdown()

    async def late():
        async for _ in client.generate(prompt(0), SamplingParams()):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(late())


def test_invalid_request_is_refused_before_queueing(async_engine):
    async def main():
        async for _ in async_engine.generate([], SamplingParams()):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())


def test_push_hands_each_output_to_its_sink_in_order_and_generate_agrees(async_engine):
    """``push``: the same outputs as ``generate`` (greedy), each given to the sink on the caller's
    event loop as it comes, the last one ``finished``; closing a finished run leaves nothing open."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        pushed: list = []
        loops: set = set()
        done = loop.create_future()

        def sink(out):
            loops.add(asyncio.get_running_loop())  # the caller's loop: the hand-over calls it there
            pushed.append(out)
            if out.finished:
                done.set_result(None)

        close = async_engine.push(prompt(7), params, sink, request_id="pushed")
        assert async_engine.num_in_flight == 1
        await asyncio.wait_for(done, 60)
        close(True)
        assert async_engine.num_in_flight == 0
        tokens, last = await collect(async_engine, prompt(7), params)
        assert loops == {loop}
        return pushed, tokens, last

    pushed, tokens, last = asyncio.run(main())
    assert [t for out in pushed for t in out.new_token_ids] == tokens and len(tokens) == 12
    assert [out.finished for out in pushed] == [False] * (len(pushed) - 1) + [True]
    assert pushed[-1].finish_reason == last.finish_reason == "length"


def test_closing_an_unfinished_push_aborts_it_and_frees_its_blocks(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        got: list = []
        started = asyncio.Event()

        def sink(out):
            got.append(out)
            if len(got) >= 3:
                started.set()

        close = async_engine.push(prompt(3), params, sink, request_id="left")
        await asyncio.wait_for(started.wait(), 60)
        close(False)
        count, steps = len(got), async_engine.num_steps
        deadline = loop.time() + 30
        while async_engine.stats.num_running or async_engine.stats.kv_used_blocks:
            assert loop.time() < deadline, async_engine.stats
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return count, got, async_engine.num_steps - steps

    count, got, steps_after = asyncio.run(main())
    assert len(got) == count and not got[-1].finished  # nothing reaches a closed sink
    assert steps_after < 20  # aborted: not the ~190 steps left of its 200 tokens
    assert async_engine.num_in_flight == 0


def test_push_refuses_an_invalid_request_at_once(async_engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            async_engine.push([], SamplingParams(max_tokens=4), lambda out: None)
        assert async_engine.num_in_flight == 0

    asyncio.run(main())
