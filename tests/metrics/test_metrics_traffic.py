"""/metrics against real traffic: counters equal the responses' usage, gauges follow the load."""
from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow

# ~200 tokens shared by several prompts: the later ones hit the prefix cache (block size 16).
SHARED = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 12
HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prompt_tokens", "request_generation_tokens")


def delta(before, after, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def complete(client: httpx.Client, model: str, prompt: str, **fields) -> tuple[dict, str]:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0, **fields})
    r.raise_for_status()
    body = r.json()
    return body["usage"], body["choices"][0]["finish_reason"]


def chat_sdk(url: str, model: str, system: str, user: str, stream: bool, max_tokens: int) -> tuple[dict, str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if not stream:
        resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})
        return resp.usage.model_dump(), resp.choices[0].finish_reason
    usage, reason = None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    assert usage is not None and reason is not None
    return usage, reason


def test_counters_and_histograms_match_usage(live_server):
    s, model = live_server, live_server.model
    before = s.scrape()
    started = time.monotonic()
    results = []
    with s.client() as c:
        for i, max_tokens in enumerate((6, 4, 5)):  # completions sharing SHARED: 2nd and 3rd hit the cache
            results.append(complete(c, model, f"{SHARED}Question {i}: what", max_tokens=max_tokens, ignore_eos=True))
        # A stop string the greedy continuation of a count reaches at once: finish_reason "stop".
        results.append(complete(c, model, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", max_tokens=8, stop=[","]))
    results.append(chat_sdk(s.url, model, SHARED, "Say hi.", stream=False, max_tokens=4))
    results.append(chat_sdk(s.url, model, SHARED, "Say hello.", stream=True, max_tokens=3))  # hits the cache
    after = s.scrape()
    wall = time.monotonic() - started

    n = len(results)
    usages = [u for u, _ in results]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0, usages
    assert delta(before, after, "kvserve_prompt_tokens_total") == prompt
    assert delta(before, after, "kvserve_generation_tokens_total") == completion
    assert delta(before, after, "kvserve_prefix_cache_queries_total") == prompt
    assert delta(before, after, "kvserve_prefix_cache_hits_total") == cached
    for h in HISTOGRAMS:
        assert delta(before, after, f"kvserve_{h}_count") == n, h
    assert delta(before, after, "kvserve_request_prompt_tokens_sum") == prompt
    assert delta(before, after, "kvserve_request_generation_tokens_sum") == completion
    # Every token after a request's first has one inter-token gap.
    assert delta(before, after, "kvserve_inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    # Each step runs the uncached prompt tokens (the first token comes with the prefill), then one per decode.
    # The stop string is found by the frontend's output processor, which then aborts the request in the
    # core: the core may run one or two more decode steps of it meanwhile (tokens nobody receives).
    expected = prompt - cached + completion - n
    assert expected <= delta(before, after, "kvserve_iteration_tokens_sum") <= expected + 2
    # Every step that ran tokens is timed once, by the core; its steps run one after another, so
    # their time is a part of the wall time between the scrapes.
    steps = delta(before, after, "kvserve_iteration_tokens_count")
    assert delta(before, after, "kvserve_engine_step_seconds_count") == steps > 0
    assert 0 < delta(before, after, "kvserve_engine_step_seconds_sum") < wall
    assert delta(before, after, "kvserve_engine_step_seconds_bucket", le="+Inf") == steps
    assert delta(before, after, "kvserve_time_to_first_token_seconds_sum") <= delta(
        before, after, "kvserve_e2e_request_latency_seconds_sum")

    reasons = collections.Counter(r for _, r in results)
    assert reasons["stop"] >= 1 and reasons["length"] >= 1, reasons
    for reason in ("stop", "length"):
        assert delta(before, after, "kvserve_request_success_total", finished_reason=reason) == reasons[reason]
    for reason in ("abort", "error"):
        assert delta(before, after, "kvserve_request_errors_total", reason=reason) == 0
    assert delta(before, after, "kvserve_num_preemptions_total") == 0


# 64 tokens and a 50 ms poll: at 32 tokens and 200 ms a fast host finished the batch between two scrapes
NUM_CONCURRENT, MAX_TOKENS = 4, 64


def test_gauges_follow_a_concurrent_load(live_server):
    s, model = live_server, live_server.model
    capacity = s.scrape().get("kvserve_kv_cache_capacity_tokens")
    seen = []

    def one(i: int) -> dict:
        with s.client() as c:
            usage, _ = complete(c, model, f"Story number {i}: once upon a time, in a land far away, there lived",
                                max_tokens=MAX_TOKENS, ignore_eos=True)
            return usage

    def loaded(x) -> bool:
        return (x.get("kvserve_num_requests_running") >= 2 and x.get("kvserve_kv_cache_usage_perc") > 0
                and x.get("kvserve_kv_cache_used_tokens") > 0)

    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        futures = [pool.submit(one, i) for i in range(NUM_CONCURRENT)]
        # Poll until the batch shows up, then stop: scrapes share the GIL with the engine thread.
        while not all(f.done() for f in futures) and not (seen and loaded(seen[-1])):
            seen.append(s.scrape())
            time.sleep(0.05)
        usages = [f.result() for f in futures]
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)

    assert any(loaded(x) for x in seen), "never saw a batch holding KV blocks"  # >= 2: they ran batched
    for x in seen:  # the token gauge is the block fraction in token units
        assert x.get("kvserve_kv_cache_used_tokens") == pytest.approx(
            x.get("kvserve_kv_cache_usage_perc") * capacity)
        assert 0 <= x.get("kvserve_kv_cache_usage_perc") <= 1

    # A response comes back only after the engine finished the request and freed its blocks.
    idle = s.scrape()
    assert idle.get("kvserve_num_requests_running") == 0
    assert idle.get("kvserve_num_requests_waiting") == 0
    assert idle.get("kvserve_kv_cache_usage_perc") == 0
    assert idle.get("kvserve_kv_cache_used_tokens") == 0
    # Freed full blocks stay hashed for reuse: at least each prompt's first full block.
    assert idle.get("kvserve_kv_cache_cached_blocks") >= NUM_CONCURRENT


def test_aborts_count_as_errors_and_rejections_do_not(live_server):
    s, model = live_server, live_server.model
    before = s.scrape()
    with s.client() as c:
        # Rejected by validation before reaching the engine: a 400, counted nowhere.
        r = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4096})
        assert r.status_code == 400
        # A streaming client that leaves after the first chunk: the engine aborts its request.
        with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "Tell me a long story.",
                                                        "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    # The frontend counts the abort as the client leaves; the gauges follow with the core's next
    # snapshot, sent once it has handled the abort. Wait for both (a deadline, not a fixed sleep).
    deadline = time.monotonic() + 30
    while True:
        after = s.scrape()
        settled = (after.get("kvserve_num_requests_running") == 0
                   and after.get("kvserve_kv_cache_usage_perc") == 0)
        if (delta(before, after, "kvserve_request_errors_total", reason="abort") and settled
                or time.monotonic() > deadline):
            break
        time.sleep(0.1)
    state = {k: after.get(f"kvserve_{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                     "generation_tokens_total")}
    assert delta(before, after, "kvserve_request_errors_total", reason="abort") == 1, state
    assert delta(before, after, "kvserve_request_errors_total", reason="error") == 0
    for reason in ("stop", "length"):
        assert delta(before, after, "kvserve_request_success_total", finished_reason=reason) == 0
    # Latency and length histograms describe finished requests only; the streamed tokens still count.
    assert delta(before, after, "kvserve_e2e_request_latency_seconds_count") == 0
    assert delta(before, after, "kvserve_time_to_first_token_seconds_count") == 1
    assert delta(before, after, "kvserve_generation_tokens_total") >= 1
    assert after.get("kvserve_num_requests_running") == 0
    assert after.get("kvserve_kv_cache_usage_perc") == 0


def test_cache_config_info(live_server):
    scrape = live_server.scrape()
    info = scrape.labels_of("kvserve_cache_config_info")
    cap = live_server.engine.info
    assert scrape.get("kvserve_cache_config_info") == 1
    # this server runs kvserve's CPU defaults: fp16 KV blocks under the float32 model
    assert info == {"model_name": live_server.model, "block_size": str(cap.block_size),
                    "num_blocks": str(cap.num_blocks), "cache_dtype": "float16", "enable_prefix_caching": "true"}
    assert scrape.get("kvserve_kv_cache_capacity_tokens") == cap.num_blocks * cap.block_size
    # Every sample carries the model name.
    assert all(dict(labels).get("model_name") == live_server.model for _, labels in scrape.samples)
