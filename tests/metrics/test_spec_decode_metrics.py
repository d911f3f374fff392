"""Speculative decoding's counters on /metrics (kvserve's names and, under ``--metrics-compat vllm``,
vLLM's) equal the sums of the per-request acceptances, on a tiny engine served in a thread with
16 concurrent streams, some of them aborted mid-stream."""
from __future__ import annotations

import asyncio
import random
import subprocess

import pytest
from prometheus_client import generate_latest

from kvtypes.sampling_params import SamplingParams
from scheduler.config import SpeculativeConfig
from tests.helpers import tiny_engine, tiny_hf_model
from tests.metrics.conftest import Scrape
from tests.metrics.promtool import promtool

NAMES = {"num_drafts": "spec_num_drafts", "num_draft_tokens": "spec_num_draft_tokens",
         "num_accepted_tokens": "spec_num_accepted_tokens"}


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(11)
    out = []
    for i in range(n):
        passage = [rng.randrange(3, 128) for _ in range(9)]
        # Half copy-heavy (drafts get accepted), half random (drafts get rejected).
        out.append(passage * 3 + passage[:3] if i % 2 == 0 else [rng.randrange(3, 128) for _ in range(20)])
    return out


async def drive(client, ps: list[list[int]], abort_every: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def one(i: int, p: list[int]) -> None:
        stream = client.generate(p, params)
        got = 0
        async for out in stream:
            got += 1
            if i % abort_every == 1 and got == 3:  # the caller leaves: the request is aborted
                await stream.aclose()
                return

    await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))


@pytest.fixture(scope="module")
def served():
    """The tiny engine with speculation, in an in-process client whose observer is the metrics."""
    from engine.core.client import InprocEngineClient
    from server import metrics_compat
    from server.metrics import Metrics

    engine = tiny_engine(tiny_hf_model(), num_blocks=256, max_num_seqs=16)
    engine.scheduler.config.speculative_config = SpeculativeConfig(num_speculative_tokens=4, verify_cost_ratio=0,
                                                                   disable_by_batch_size=None)  # draft always
    requests = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda r: (requests.append(r), add(r))[1]  # keep every request seen
    client = InprocEngineClient(engine)
    client.start()
    metrics = Metrics(client.info)
    metrics_compat.enable(metrics, "vllm")
    client.observer = metrics
    try:
        yield engine, client, metrics, requests
    finally:
        client.shutdown()


def settle(engine, client) -> None:
    """Wait until the core is idle and its last snapshot has reached the observer."""
    import time

    deadline = time.monotonic() + 60
    while engine.has_unfinished() or client.num_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)


def test_spec_counters_equal_the_per_request_sums_under_16_streams_with_aborts(served):
    engine, client, metrics, requests = served
    scrape0 = Scrape.parse(generate_latest(metrics.exposition).decode())
    for name in NAMES:  # exported, at zero, before any draft
        assert scrape0.get(f"kvserve_spec_decode_{name}_total") == 0
        assert scrape0.get(f"vllm:spec_decode_{name}_total") == 0
    asyncio.run(drive(client, prompts(16), abort_every=4))
    settle(engine, client)
    text = generate_latest(metrics.exposition).decode()
    scrape = Scrape.parse(text)

    assert len(requests) == 16
    sums = {name: sum(getattr(r, attr) for r in requests) for name, attr in NAMES.items()}
    assert sums["num_drafts"] > 0 and 0 < sums["num_accepted_tokens"] < sums["num_draft_tokens"]
    stats = engine.scheduler.stats
    assert (stats.spec_num_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == tuple(sums.values())
    for name, total in sums.items():
        assert scrape.get(f"kvserve_spec_decode_{name}_total") == total, name
        assert scrape.get(f"vllm:spec_decode_{name}_total") == total, name
    per_pos = [scrape.get("kvserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(len(stats.spec_accepted_per_pos))]
    assert per_pos == stats.spec_accepted_per_pos
    assert sum(per_pos) == sums["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= sums["num_drafts"]
    for i, n in enumerate(per_pos):
        assert scrape.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) == n
    assert scrape.families["vllm:spec_decode_num_accepted_tokens"].type == "counter"
    # Nothing leaked: aborted and finished requests gave every block back.
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    own = generate_latest(metrics.registry).decode()  # the kvserve_ exposition, as test_promtool lints it
    done = subprocess.run([promtool(), "check", "metrics"], input=own, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
