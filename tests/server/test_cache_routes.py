"""Prompt-cache retention over real HTTP: cache_control pins, usage, GET/DELETE /v1/cache."""
from __future__ import annotations

import httpx

SYSTEM = ("You are a meticulous assistant for a library catalogue. Answer in one short sentence, "
          "cite the shelf code when you know it, and never invent a title that is not in the catalogue. ") * 3


def chat(http, question: str, **extra):
    body = {"model": "x", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                         {"role": "user", "content": question}], **extra}
    return http.post("/v1/chat/completions", json=body)


def test_cache_control_pins_lists_and_unpins(live_server, http, openai_schemas):
    model = live_server.model
    first = http.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 2, "temperature": 0, "prompt_cache_key": "tenant-a/catalogue",
        "messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM,
                                                      "cache_control": {"type": "ephemeral"}}]},
                     {"role": "user", "content": "Where is Moby Dick?"}]})
    assert first.status_code == 200, first.text
    body = first.json()
    openai_schemas.validate("CreateChatCompletionResponse", body)
    written = body["usage"]["prompt_tokens_details"]["cache_write_tokens"]
    assert written >= 32 and written % 16 == 0

    listing = http.get("/v1/cache").json()
    assert [p["tokens"] for p in listing["data"]] == [written]
    pin = listing["data"][0]
    assert 0 < pin["ttl_left_seconds"] <= 300 and pin["salt_id"] is None  # default ttl 5m

    # A second request with the same system prompt hits it (and a 1h breakpoint refreshes the pin).
    second = chat(http, "Where is Emma?", model=model).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= written
    assert len(http.get("/v1/cache").json()["data"]) >= 1

    assert httpx.get(f"{live_server.base_url}/v1/cache").status_code == 401  # behind the API key
    for p in http.get("/v1/cache").json()["data"]:
        deleted = http.delete(f"/v1/cache/{p['hash']}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert http.get("/v1/cache").json()["data"] == []
    missing = http.delete(f"/v1/cache/{pin['hash']}")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "hash"
    assert http.delete("/v1/cache/..%2F..%2Fetc").status_code == 404
    assert live_server.wait_idle(timeout=10)  # the unpinned blocks are free again
    assert live_server.engine.stats.kv_pinned_blocks == 0  # (the pool's invariants: tests/cache_tiers)


def test_cache_parameters_are_validated(live_server, http):
    model = live_server.model
    body = {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]
    r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}],
                                                 "prompt_cache_retention": "forever"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    # 24h retention needs the disk tier, which this server does not run.
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1,
                                           "prompt_cache_retention": "24h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1,
                                           "prompt_cache_retention": "in_memory", "prompt_cache_key": "k"})
    assert r.status_code == 200
    for p in http.get("/v1/cache").json()["data"]:
        http.delete(f"/v1/cache/{p['hash']}")
    assert live_server.wait_idle(timeout=10)
