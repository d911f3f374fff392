"""The engine core loop with the features merged into it: no busy spin on stalled steps, idle
housekeeping and stats-only snapshots, ``close`` on every exit, ``Unpin``, and the new
per-request fields (prompt logprobs, cache-write tokens) travelling core -> output processor.
"""
from __future__ import annotations

import asyncio
import pickle
import queue
import random
import threading
import time

import pytest

from engine.core.loop import BURST_GAPS, IDLE_POLL_S, STALLED_WAIT_S, EngineCore
from engine.core.client import InprocEngineClient
from engine.core.protocol import (AddRequest, EngineCoreOutput, EngineCoreOutputs, PinSnapshot, Shutdown, StepStats,
                                  Unpin)
from kvtypes.cache_policy import CachePolicy
from kvtypes.sampling_params import SamplingParams
from kvtypes.structured_spec import StructuredOutputSpec
from tests.helpers import tiny_engine, tiny_hf_model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


class StalledEngine:
    """An engine whose one live request never runs a token (its grammar never compiles)."""

    def __init__(self) -> None:
        self.steps = 0
        self.housekeeping_calls = 0
        self.closed = 0
        self.last_step_tokens = 0
        self.live = False

    def has_unfinished(self) -> bool:
        return self.live

    def add_request(self, *args) -> str:
        self.live = True
        return "r"

    def step(self) -> list[EngineCoreOutput]:
        self.steps += 1
        return []

    def stats(self, step_time_s: float = 0.0, num_batched_tokens: int = 0) -> StepStats:
        return StepStats(num_batched_tokens=num_batched_tokens)

    def stats_changed(self) -> bool:
        return False

    def housekeeping(self) -> None:
        self.housekeeping_calls += 1

    def abort(self, rid: str):
        self.live = False
        return EngineCoreOutput(rid, [], finish_reason="abort")

    def abort_all(self, status) -> list[EngineCoreOutput]:
        out = [EngineCoreOutput("r", [], finish_reason="abort")] if self.live else []
        self.live = False
        return out

    def close(self) -> None:
        self.closed += 1


def run_core(engine, commands: queue.SimpleQueue, sent: list) -> threading.Thread:
    def receive(timeout: float) -> list:
        got = []
        try:
            got.append(commands.get(timeout=timeout) if timeout > 0 else commands.get_nowait())
        except queue.Empty:
            return got
        while True:
            try:
                got.append(commands.get_nowait())
            except queue.Empty:
                return got

    thread = threading.Thread(target=EngineCore(engine).run, args=(receive, sent.append), daemon=True)
    thread.start()
    return thread


def test_a_stalled_request_does_not_spin_the_loop_and_close_runs_on_shutdown():
    engine, commands, sent = StalledEngine(), queue.SimpleQueue(), []
    thread = run_core(engine, commands, sent)
    time.sleep(IDLE_POLL_S * 1.5)
    assert engine.housekeeping_calls >= 1 and engine.steps == 0  # idle: housekeeping, no steps
    commands.put(AddRequest("r", [1, 2, 3], SamplingParams()))
    time.sleep(0.5)
    steps = engine.steps
    # A spinning loop runs ~10^5 empty steps in 0.5 s; waiting STALLED_WAIT_S each allows ~250.
    assert 10 <= steps <= 0.5 / STALLED_WAIT_S * 1.2, steps
    assert sent == []  # empty steps send nothing
    commands.put(Shutdown())
    thread.join(5)
    assert not thread.is_alive() and engine.closed == 1
    assert [o.finish_reason for o in sent[-1].outputs] == ["abort"]


def test_close_runs_when_the_loop_fails():
    engine, commands, sent = StalledEngine(), queue.SimpleQueue(), []

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step
    with pytest.raises(RuntimeError):
        commands.put(AddRequest("r", [1], SamplingParams()))
        EngineCore(engine).run(lambda t: [commands.get()] if not commands.empty() else [], sent.append)
    assert engine.closed == 1


class CountingEngine(StalledEngine):
    """Records how many requests it holds at each step; a request is done after one step."""

    def __init__(self) -> None:
        super().__init__()
        self.held, self.per_step = 0, []

    def add_request(self, *args) -> str:
        self.held += 1
        return "r"

    def has_unfinished(self) -> bool:
        return self.held > 0

    def step(self) -> list[EngineCoreOutput]:
        self.per_step.append(self.held)
        self.last_step_tokens, self.held = self.held, 0
        return []


@pytest.mark.parametrize("burst_gap_s, first_step", [(0.004, 3), (0.0, 1)])
def test_an_idle_core_takes_a_burst_of_requests_into_its_first_step(burst_gap_s, first_step):
    """Requests that reach an idle core one receive after another (as a client's parallel calls
    do, a few ms apart) prefill in one step when the core waits a gap for each next one; with no
    gap the first steps alone. The core stops at Shutdown."""
    adds = [[AddRequest(f"r{i}", [1, 2], SamplingParams())] for i in range(3)]
    script = iter(adds + [[], [Shutdown()]])
    waits: list[float] = []

    def receive(timeout: float) -> list:
        waits.append(timeout)
        return next(script, [Shutdown()])

    engine = CountingEngine()
    EngineCore(engine, burst_gap_s).run(receive, lambda out: None)
    assert engine.per_step[0] == first_step
    assert sum(engine.per_step) == 3
    if burst_gap_s:
        assert waits[1:4] == pytest.approx([burst_gap_s] * 3, abs=burst_gap_s)  # a gap each, never longer


def test_a_burst_is_cut_after_its_gaps():
    """Requests that keep coming closer than the gap do not hold the first step back for longer
    than BURST_GAPS gaps."""
    gap, t0, first_step_at = 0.01, time.monotonic(), []

    def receive(timeout: float) -> list:
        if first_step_at:
            return [Shutdown()]
        time.sleep(min(timeout, 0.001))
        return [AddRequest("r", [1], SamplingParams())]

    engine = CountingEngine()
    engine.step = lambda f=engine.step: first_step_at.append(time.monotonic()) or f()
    EngineCore(engine, gap).run(receive, lambda out: None)
    assert BURST_GAPS * gap * 0.9 <= first_step_at[0] - t0 <= BURST_GAPS * gap + 0.5
    assert engine.per_step[0] > BURST_GAPS


def test_new_values_pickle_across_the_process_boundary():
    params = SamplingParams(max_tokens=4, logit_bias={5: -100.0, 7: 2.5}, prompt_logprobs=2,
                            structured_output=StructuredOutputSpec("regex", "(yes|no)"),
                            cache_policy=CachePolicy(pin_tokens=32, pin_ttl_s=300.0, retention_s=None, cache_key="k"))
    assert pickle.loads(pickle.dumps(params)) == params
    message = EngineCoreOutputs([EngineCoreOutput("r", [3], num_cache_write_tokens=32, error="invalid grammar: x")],
                                StepStats(tier_queries={"device": 40}, offload_read_seconds={"disk": [0.001]},
                                          pins=(PinSnapshot("ab" * 32, 32, 2, 300.0, 299.0),)))
    again = pickle.loads(pickle.dumps(message))
    assert again.outputs[0].num_cache_write_tokens == 32 and again.stats.pins == message.stats.pins
    assert pickle.loads(pickle.dumps(Unpin("ab" * 32))).block_hash == "ab" * 32


def test_pins_prompt_logprobs_and_unpin_through_the_client(hf_model):
    """A pinned prefix shows in the snapshots (sent while idle too), Unpin releases it, and
    prompt logprobs / cache-write tokens reach the RequestOutputs."""
    engine = tiny_engine(hf_model, num_blocks=64)
    client = InprocEngineClient(engine)
    client.start()
    try:
        rng = random.Random(3)
        ids = [rng.randrange(3, 128) for _ in range(21)]
        params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1,
                                cache_policy=CachePolicy(pin_tokens=16, pin_ttl_s=300.0))

        async def run():
            return [out async for out in client.generate(ids, params)]

        outs = asyncio.run(run())
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert len(outs[0].prompt_logprobs) == len(ids) - 1  # one per prompt token from the second on
        assert all(o.prompt_logprobs is None for o in outs[1:])
        assert outs[-1].num_cache_write_tokens == 16

        def wait(predicate, timeout=5.0):
            deadline = time.monotonic() + timeout
            while not predicate(client.stats):
                assert time.monotonic() < deadline, client.stats
                time.sleep(0.01)

        wait(lambda s: s is not None and len(s.pins) == 1)
        pin = client.stats.pins[0]
        assert pin.num_tokens == 16 and pin.num_blocks == 16 // 4 and 0 < pin.ttl_left_s <= 300
        assert client.stats.kv_pinned_blocks == 4 and client.info.max_pinned_blocks == 16
        client.unpin("00" * 32)  # unknown: ignored
        client.unpin(pin.hash)
        wait(lambda s: s.pins == () and s.kv_pinned_blocks == 0)  # the idle core reported it
    finally:
        client.shutdown()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_pinned_blocks == 0


def test_disk_tier_is_in_engine_info_and_shutdown_flushes_the_pool(hf_model, tmp_path):
    engine = tiny_engine(hf_model, num_blocks=64, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    assert engine.info.has_disk_tier and not tiny_engine(hf_model).info.has_disk_tier
    client = InprocEngineClient(engine)
    client.start()
    try:
        ids = [random.Random(5).randrange(3, 128) for _ in range(33)]

        async def run():
            return [out async for out in client.generate(ids, SamplingParams(max_tokens=2, temperature=0.0))]

        assert asyncio.run(run())[-1].finished
        assert not list(tmp_path.glob("*.kvb"))  # nothing evicted yet: the blocks are cached on the device
    finally:
        client.shutdown()
    assert len(list(tmp_path.glob("*.kvb"))) >= 33 // 4  # close() wrote the cached blocks to the tier


def test_pipe_poller_answers_as_connection_poll_does():
    """Empty, a timeout that expires, a message waiting, drained, and the writer gone (True, so
    that recv raises EOFError), each as ``Connection.poll`` answers."""
    import multiprocessing

    from engine.core.protocol import pipe_poller

    reader, writer = multiprocessing.Pipe(duplex=False)
    readable = pipe_poller(reader)
    assert readable(0) is False and reader.poll(0) is False
    t = time.monotonic()
    assert readable(0.05) is False
    assert time.monotonic() - t >= 0.04
    writer.send({"step": 1})
    assert readable(0) is True and reader.poll(0) is True
    assert reader.recv() == {"step": 1}
    assert readable(0) is False
    writer.close()
    assert readable(0) is True and reader.poll(0) is True
    with pytest.raises(EOFError):
        reader.recv()
