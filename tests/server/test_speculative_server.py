"""Speculative decoding through the real server (default model, engine core in its own process):
greedy chat completions, streamed and not, equal those of the session's server without it.

A difference is allowed only where the plain server's own top-2 logprobs at the first differing
token are a near tie (a k+1-row matmul sums in another order than a 1-row one).
"""
from __future__ import annotations

import threading

import httpx
import pytest

from bench.workload import CHAT_QUESTIONS
from tests.helpers import wait_until
from tests.server.conftest import API_KEY, SERVER_START_TIMEOUT_S, free_port, parse_sse, wait_healthy

pytestmark = pytest.mark.slow

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick and polished the great lens until it shone. Ships passing the rocky point "
           "counted on his light, and in forty years it never once failed them.")
PROMPTS = [*CHAT_QUESTIONS[:3],
           f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE}",
           f"Here is a text:\n\n{PASSAGE}\n\nCopy the text above without changing anything."]
MAX_TOKENS = 64
NEAR_TIE = 0.01  # nats between the top two candidates: float reordering can flip such a pair


@pytest.fixture(scope="module")
def spec_server():
    import uvicorn

    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from kvserve.compose import build_service
    from scheduler.config import SchedulerConfig
    from server.config import ServerConfig

    # every draft verified (the adaptive rule off), so the equality checks cover accepted and rejected drafts
    spec = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
            '"verify_cost_ratio": 0, "disable_by_batch_size": null}')
    from tests.helpers import EXACT_CACHE_FLAGS, EXACT_MODEL_FLAGS

    # the exact flags (fp32 activations and KV): speculative and plain decoding compared token for token
    service = build_service(EngineConfig(model=ModelConfig(num_threads=1, max_model_len=2048, **EXACT_MODEL_FLAGS),
                                         cache=CacheConfig(kv_cache_memory_gib=0.25, **EXACT_CACHE_FLAGS),
                                         scheduler=SchedulerConfig(max_num_seqs=32, speculative_config=spec)),
                            ServerConfig(api_key=API_KEY, max_waiting=256, log_stats_interval_s=0))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(service.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn-spec", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, SERVER_START_TIMEOUT_S)
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
            yield c, service.engine
    finally:
        server.should_exit = True
        thread.join(30)


def body(model: str, prompt: str, **extra) -> dict:
    return dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                temperature=0, **extra)


def chat(c: httpx.Client, payload: dict) -> tuple[str, int, str]:
    r = c.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"], \
        data["choices"][0]["finish_reason"]


def streamed(c: httpx.Client, payload: dict) -> str:
    with c.stream("POST", "/v1/chat/completions", json={**payload, "stream": True}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes()).decode()
    return "".join(ch["choices"][0]["delta"].get("content") or "" for ch in parse_sse(raw) if ch["choices"])


def assert_same_or_near_tie(plain_http: httpx.Client, payload: dict, plain: str, spec: str) -> None:
    if spec == plain:
        return
    r = plain_http.post("/v1/chat/completions", json={**payload, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    text = ""
    for entry in content:
        if not spec.startswith(text + entry["token"]):
            top = entry["top_logprobs"]
            gap = top[0]["logprob"] - top[1]["logprob"]
            assert gap < NEAR_TIE, (f"speculation changed the output where the model is sure (gap {gap:.4f}):\n"
                                    f"plain: {plain!r}\nspec:  {spec!r}")
            return
        text += entry["token"]
    raise AssertionError(f"outputs differ but no token does:\nplain: {plain!r}\nspec:  {spec!r}")


def test_greedy_chat_with_speculation_equals_plain(spec_server, http, live_server):
    spec_http, spec_engine = spec_server
    for prompt in PROMPTS:
        payload = body(live_server.model, prompt)
        plain_text, plain_n, plain_finish = chat(http, payload)
        spec_text, spec_n, spec_finish = chat(spec_http, payload)
        assert_same_or_near_tie(http, payload, plain_text, spec_text)
        if spec_text == plain_text:
            assert (spec_n, spec_finish) == (plain_n, plain_finish)
        assert streamed(spec_http, payload) == spec_text  # the multi-token steps stream the same text
    # A response's stream closes after its last bytes reach the client, so the count is polled.
    wait_until(lambda: spec_engine.num_in_flight == 0, 10, "no request in flight")


def test_copy_prompt_accepts_drafts(spec_server, live_server):
    """Speculation really ran: a copy prompt's run takes fewer engine steps than it has tokens."""
    spec_http, spec_engine = spec_server
    payload = body(live_server.model, PROMPTS[3], stream=True)
    with spec_http.stream("POST", "/v1/chat/completions", json=payload) as r:
        raw = b"".join(r.iter_bytes()).decode()
    chunks = [ch for ch in parse_sse(raw) if ch["choices"] and ch["choices"][0]["delta"].get("content")]
    text = "".join(ch["choices"][0]["delta"]["content"] for ch in chunks)
    tokens = len(spec_engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokens > 20
    # One chunk per engine step that produced text: accepted drafts give several tokens per chunk.
    assert len(chunks) < tokens * 0.8, (len(chunks), tokens)


def test_stop_string_inside_a_speculative_run(spec_server, http, live_server):
    spec_http, _ = spec_server
    payload = body(live_server.model, PROMPTS[3], stop=["polished the"])
    plain = chat(http, payload)
    spec = chat(spec_http, payload)
    assert spec == plain and plain[2] == "stop"
    assert streamed(spec_http, payload) == plain[0]
