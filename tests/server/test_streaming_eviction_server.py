"""StreamingLLM eviction (``--kv-eviction streaming``) through the real server, default model.

Two servers with a 256-token context, a 64-token window and 64-token prefill chunks (as the
issue's reference evicts in transformers' cache, 64 tokens at a time, without recomputation):
one with 4 sink tokens (one 16-token block), one with none. The session's dense server
(2048-token context) is the reference.

Quality (teacher-forced NLL of CPython's ``pydoc_data.topics``, its first 384 tokens, scored on
tokens 160-383, i.e. past twice the window and past the context of the evicting servers, whose
keys are re-rotated as they go): dense 2.982 nats/token; sinks + window +0.126; window only
+1.241, the paper's failure without sinks. (Measured in-process on longer runs: 512 tokens from
192, +0.199 / +1.310; 1000 tokens with a 128-token window from 384, +0.132 / +0.768; the issue's
transformers reference, a 1024-token window on tokens 2048-6000: +0.046 / +0.589.) The
assertions leave room around those numbers: sinks within 0.35 of dense, window-only at least
0.6 worse than sinks + window.
"""
from __future__ import annotations

import math
import threading

import httpx
import pytest
import torch

from tests.helpers import serve_inprocess

CONTEXT, WINDOW, CHUNK, NUM_BLOCKS = 256, 64, 64, 40  # the pool: 640 tokens
TEXT_TOKENS, SCORED_FROM = 384, 160


def _engine(sinks: int):
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from scheduler.config import SchedulerConfig

    config = EngineConfig(model=ModelConfig(num_threads=1, max_model_len=CONTEXT),
                          cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_eviction="streaming", kv_sink_tokens=sinks,
                                            kv_window_tokens=WINDOW),
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=32))
    return LLMEngine(config, load_model(None, torch.float32, False))


@pytest.fixture(scope="module")
def streaming():
    """{sinks: (httpx client, LLMEngine)} for 4 sinks and none."""
    servers, clients, out = [], [], {}
    try:
        for sinks in (4, 0):
            engine = _engine(sinks)
            server = serve_inprocess(engine)
            servers.append(server)
            clients.append(httpx.Client(base_url=server.url, timeout=300))
            out[sinks] = (clients[-1], engine)
        yield out
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


@pytest.fixture(scope="module")
def text_ids(streaming):
    from pydoc_data.topics import topics

    tokenizer = streaming[4][1].tokenizer
    return tokenizer("\n".join(topics[k] for k in sorted(topics)))["input_ids"][:TEXT_TOKENS]


def _prompt_logprobs(client, model: str, ids: list[int], **extra) -> tuple[list[float], dict]:
    r = client.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                             "echo": True, "logprobs": 1, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) >= len(ids)
    return lps[1:len(ids)], body


def _wait_idle(engine) -> None:
    import time

    for _ in range(500):
        if engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0:
            break
        time.sleep(0.02)


def test_sinks_plus_window_stay_near_dense_and_window_only_does_not(streaming, text_ids, live_server):
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=300) as dense_client:
        dense, _ = _prompt_logprobs(dense_client, live_server.model, text_ids)
    sinks, body = _prompt_logprobs(streaming[4][0], streaming[4][1].model_name, text_ids)
    window, _ = _prompt_logprobs(streaming[0][0], streaming[0][1].model_name, text_ids)
    assert body["usage"]["evicted_tokens"] > TEXT_TOKENS - CONTEXT  # kvserve's usage extension

    def nll(lps):
        scored = lps[SCORED_FROM - 1:]
        assert all(math.isfinite(v) for v in scored)
        return -sum(scored) / len(scored)

    d, s, w = nll(dense), nll(sinks), nll(window)
    print(f"NLL dense {d:.3f}, sinks + window {s - d:+.3f}, window only {w - d:+.3f}")
    assert s - d < 0.35, (d, s, w)
    assert w - s > 0.6, (d, s, w)


def test_a_prompt_of_three_contexts_is_served_in_a_pool_smaller_than_it(streaming, text_ids):
    client, engine = streaming[4]
    ids = (text_ids * 2)[:3 * CONTEXT]
    assert len(ids) > NUM_BLOCKS * 16  # it could not be held whole
    r = client.post("/v1/completions", json={"model": engine.model_name, "prompt": ids, "max_tokens": 4,
                                             "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == 4 and all(math.isfinite(v) for v in lps)
    assert body["usage"]["evicted_tokens"] >= len(ids) - engine.info.kv_max_held_tokens
    _wait_idle(engine)
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_blocks_held() == 0


def test_an_evicting_stream_among_sixteen_others_leaks_no_block(streaming, text_ids):
    client, engine = streaming[4]
    model = engine.model_name
    results: list[int] = []

    def short(i: int) -> None:
        r = client.post("/v1/completions", json={"model": model, "prompt": text_ids[i * 8:i * 8 + 24],
                                                 "max_tokens": 8, "temperature": 0})
        results.append(r.status_code)

    def long() -> None:
        with client.stream("POST", "/v1/completions", json={"model": model, "prompt": text_ids[:200],
                                                            "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                                                            "stream": True}) as r:
            results.append(r.status_code)
            assert sum(1 for line in r.iter_lines() if line.startswith("data: {")) >= 64

    threads = [threading.Thread(target=long)] + [threading.Thread(target=short, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == [200] * 17 or sorted(results) == [200] * 17
    _wait_idle(engine)
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_blocks_held() == 0
    assert engine.kv_cache.num_evicted_blocks_total > 0
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("policy")): s.value
               for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples}
    blocks = samples[("kvserve_kv_evicted_blocks_total", "streaming")]
    assert blocks > 0 and samples[("kvserve_kv_evicted_tokens_total", "streaming")] == 16 * blocks
    assert samples[("kvserve_kv_eviction_compression_ratio", "streaming")] >= 1.0  # the latest snapshot's


def test_the_per_request_field_and_its_400s(streaming, text_ids, live_server):
    client, engine = streaming[4]
    over = {"model": engine.model_name, "prompt": text_ids[:CONTEXT + 10], "max_tokens": 4}
    r = client.post("/v1/completions", json={**over, "kv_eviction": False})  # opted out: the context bounds it
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = client.post("/v1/completions", json={**over, "max_tokens": 8})  # evicting: past the context
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={**over, "kv_eviction": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_eviction", r.text
    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=60) as dense:
        r = dense.post("/v1/completions", json={"model": live_server.model, "prompt": text_ids[:20], "max_tokens": 2,
                                                "kv_eviction": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_eviction", r.text
    assert "evicted_tokens" not in client.post("/v1/completions", json={**over, "prompt": text_ids[:20]}).json()["usage"]
