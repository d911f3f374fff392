"""Process mode: who reads the engine core's step outputs.

Once the server's event loop is bound (``MPEngineClient.bind_loop``, done by the app's lifespan),
that loop reads the pipe itself, so each step costs no thread hop and no self-pipe wake-up; before
that, and again after the loop closes, the supervisor thread reads. The observer (metrics) runs
wherever the outputs are read, so the thread it runs on shows who read them.
"""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engine.core.process_client import MPEngineClient
from kvtypes.sampling_params import SamplingParams
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


class ThreadRecorder:
    """An engine observer that records the name of the thread each step arrives on."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.threads: list[str] = []

    def on_step(self, stats, outputs) -> None:
        self.threads.append(threading.current_thread().name)
        if self.inner is not None:
            self.inner.on_step(stats, outputs)


def test_the_servers_event_loop_reads_the_outputs(live_server):
    engine = live_server.engine
    assert isinstance(engine, MPEngineClient)
    recorder = ThreadRecorder(engine.observer)
    engine.observer = recorder
    try:
        r = httpx.post(f"{live_server.v1}/completions", headers=live_server.headers, timeout=60,
                       json={"model": live_server.model, "prompt": "Hello", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        engine.observer = recorder.inner
    assert recorder.threads and set(recorder.threads) == {"test-uvicorn"}  # the thread running the server's loop


def test_reading_moves_to_a_bound_loop_and_back_when_it_closes():
    import argparse

    from kvserve.cli import add_engine_args, build_engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config, _ = build_engine_config(parser.parse_args(["--num-threads", "1", "--max-model-len", "256"]))
    recorder = ThreadRecorder()
    client = MPEngineClient(config, observer=recorder)
    client.start()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = client.tokenizer.encode("The capital of France is")

    async def tokens() -> list[int]:
        return [t async for out in client.generate(prompt, params) for t in out.new_token_ids]

    def steps_since(mark: int) -> set[str]:
        return set(recorder.threads[mark:])

    try:
        first = asyncio.run(tokens())  # no loop bound: the supervisor reads
        assert steps_since(0) == {"kvserve-core-supervisor"}

        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_forever, name="bound-loop", daemon=True)
        runner.start()
        client.bind_loop(loop)
        wait_until(lambda: client.outputs_read_on_loop)
        mark = len(recorder.threads)
        assert asyncio.run_coroutine_threadsafe(tokens(), loop).result(60) == first
        assert steps_since(mark) == {"bound-loop"}

        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
        wait_until(lambda: not client.outputs_read_on_loop)
        mark = len(recorder.threads)
        assert asyncio.run(tokens()) == first  # the supervisor took the pipe back
        assert steps_since(mark) == {"kvserve-core-supervisor"}
        assert len(first) == 5 and client.is_healthy
    finally:
        client.shutdown()
