"""Tenants over real HTTP (``--api-key-file``): isolation of the prefix cache, pins and stored
responses; per-tenant limits; priority; reload on SIGHUP; per-tenant metrics; and no key, digest
or salt in logs, error bodies or /metrics.

The server is what ``kvserve serve`` builds (``kvserve.compose.build_service``) around a tiny
random-weight model with the default model's tokenizer (so the chat routes run), in thread mode.
The engine client's ``generate`` is wrapped to record what each engine request carries (tenant,
priority, salt) and to hold a tenant's requests at a gate, which makes "in flight" exact without
any timing. Tests of this module share the server and run in order (the last one reads the logs
and error bodies all of them produced).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.tenants import parse_key_file
from tests.helpers import push_through, tiny_engine, tiny_hf_model, tiny_llama_config

KEYS = {"alpha": "sk-alpha-secret-1", "beta": "sk-beta-secret-1", "gamma": "sk-gamma-secret-1",
        "delta": "sk-delta-secret-1", "ops": "sk-ops-secret-1"}
NEW_ALPHA_KEY = "sk-alpha-secret-2"
GAMMA_SALT = "gamma-salt-secret"


def key_file_text(alpha_keys: list[str], with_beta: bool = True) -> str:
    beta = (f"  - name: beta\n    keys: [\"sha256:{hashlib.sha256(KEYS['beta'].encode()).hexdigest()}\"]\n"
            "    priority: 3\n") if with_beta else ""
    return ("tenants:\n"
            f"  - name: alpha\n    keys: [{', '.join(alpha_keys)}]\n"
            f"{beta}"
            f"  - name: gamma\n    keys: [{KEYS['gamma']}]\n    max_concurrent_requests: 2\n"
            f"    allow: [inference]\n    cache_salt: {GAMMA_SALT}\n"
            f"  - name: delta\n    keys: [{KEYS['delta']}]\n    tokens_per_minute: 120\n"
            f"  - name: ops\n    keys: [{KEYS['ops']}]\n    allow: [metrics]\n")


SYSTEM_600 = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly." for i in range(100))


class Recorder(logging.Handler):
    """Every record of kvserve's own loggers (and uvicorn's), formatted."""

    PREFIXES = ("server", "engine", "kvserve", "scheduler", "cache", "uvicorn", "fastapi")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(self.PREFIXES):
            self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)


@pytest.fixture(scope="module")
def srv(tokenizer, tmp_path_factory):
    from bench.server import start_inprocess
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    path = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    path.write_text(key_file_text([KEYS["alpha"]]))
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=2048,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    engine = tiny_engine(tiny_hf_model(config), block_size=16, num_blocks=512, max_num_batched_tokens=1024,
                         tokenizer=tokenizer, scheduling_policy="priority")
    recorder = Recorder()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(recorder)
    root.setLevel(logging.INFO)
    service = build_service(EngineConfig(), ServerConfig(api_key_file=str(path), log_stats_interval_s=0,
                                                         metrics_compat="vllm"), engine=engine)
    client = service.engine
    generate = client.generate
    calls: list[tuple] = []
    gates: dict[str, threading.Event] = {}

    def gated(prompt_ids, params, request_id=None, cache_salt=None, priority=0, tenant=None):
        calls.append((tenant, priority, cache_salt))

        async def run():
            gate = gates.get(tenant)
            while gate is not None and not gate.is_set():
                await asyncio.sleep(0.01)
            async for out in generate(prompt_ids, params, request_id, cache_salt, priority, tenant):
                yield out
        return run()

    client.generate = gated
    client.push = push_through(gated)
    server = start_inprocess(service.app, client.model_name)
    server.path, server.calls, server.gates, server.log = path, calls, gates, recorder
    server.tenancy = service.app.state.serving.tenancy
    server.errors = []  # every error body the tests saw
    try:
        yield server
    finally:
        server.close()
        root.removeHandler(recorder)
        root.setLevel(old_level)


def call(srv, method: str, path: str, key: str | None, json: dict | None = None,
         anthropic: bool = False) -> httpx.Response:
    headers = {} if key is None else ({"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"})
    r = httpx.request(method, f"{srv.url}{path}", json=json, headers=headers, timeout=120)
    if r.status_code >= 400:
        srv.errors.append(r.text + repr(dict(r.headers)))
    return r


def chat(srv, tenant: str, content: str = "hi", system: str | None = None, **extra) -> httpx.Response:
    messages = ([{"role": "system", "content": system, **extra.pop("system_extra", {})}] if system else []) + \
        [{"role": "user", "content": content}]
    return call(srv, "POST", "/v1/chat/completions", KEYS.get(tenant, tenant),
                {"model": srv.model, "messages": messages, "max_tokens": extra.pop("max_tokens", 2), **extra})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_keys_authenticate_their_tenant_and_nothing_else(srv):
    for key in (None, "sk-nobody", "sha256:" + hashlib.sha256(KEYS["beta"].encode()).hexdigest()):
        r = chat(srv, key) if key is not None else call(srv, "POST", "/v1/chat/completions", None, {})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    m = call(srv, "POST", "/v1/messages", "sk-nobody", {"model": srv.model, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "hi"}]},
             anthropic=True)
    assert m.status_code == 401 and m.json()["type"] == "error" and m.json()["error"]["type"] == "authentication_error"
    assert chat(srv, "beta").status_code == 200  # a key stored as its sha256 digest
    assert chat(srv, "ops").status_code == 403  # no inference right
    assert chat(srv, "ops").json()["error"]["code"] == "permission_denied"
    assert srv.calls[-1][0] == "beta"


def test_two_tenants_each_hit_only_their_own_prefix(srv):
    assert cached(chat(srv, "alpha", system=SYSTEM_600)) == 0
    first = chat(srv, "alpha", system=SYSTEM_600)
    assert first.json()["usage"]["prompt_tokens"] >= 600 and cached(first) >= 592
    assert cached(chat(srv, "beta", system=SYSTEM_600)) == 0  # the same prompt, no cache_salt: not alpha's
    assert cached(chat(srv, "beta", system=SYSTEM_600)) >= 592
    assert cached(chat(srv, "alpha", system=SYSTEM_600, cache_salt="s1")) == 0  # a salt splits within alpha
    assert cached(chat(srv, "alpha", system=SYSTEM_600, cache_salt="s1")) >= 592
    assert cached(chat(srv, "gamma", system=SYSTEM_600)) == 0  # its own configured salt
    r = chat(srv, "alpha", cache_salt="kvserve-tenant:5:x")  # the tenants' salt namespace is reserved
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_cache_admin_sees_and_deletes_only_its_own_pins(srv):
    pin = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert chat(srv, "alpha", system="alpha's pinned prefix. " * 20, system_extra=pin).status_code == 200
    assert chat(srv, "beta", system="beta's pinned prefix. " * 20, system_extra=pin).status_code == 200
    mine = call(srv, "GET", "/v1/cache", KEYS["alpha"]).json()["data"]
    theirs = call(srv, "GET", "/v1/cache", KEYS["beta"]).json()["data"]
    assert len(mine) == 1 and len(theirs) == 1 and mine[0]["hash"] != theirs[0]["hash"]
    foreign = call(srv, "DELETE", f"/v1/cache/{theirs[0]['hash']}", KEYS["alpha"])
    unknown = call(srv, "DELETE", f"/v1/cache/{'0' * 64}", KEYS["alpha"])
    assert foreign.status_code == unknown.status_code == 404 and foreign.json() == unknown.json()
    assert [p["hash"] for p in call(srv, "GET", "/v1/cache", KEYS["beta"]).json()["data"]] == [theirs[0]["hash"]]
    r = call(srv, "GET", "/v1/cache", KEYS["gamma"])  # inference only
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert call(srv, "DELETE", f"/v1/cache/{mine[0]['hash']}", KEYS["alpha"]).json()["deleted"] is True
    assert call(srv, "GET", "/v1/cache", KEYS["alpha"]).json()["data"] == []


def test_stored_responses_belong_to_their_tenant(srv):
    r = call(srv, "POST", "/v1/responses", KEYS["alpha"], {"model": srv.model, "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert call(srv, "GET", f"/v1/responses/{rid}", KEYS["alpha"]).status_code == 200
    foreign = call(srv, "GET", f"/v1/responses/{rid}", KEYS["beta"])
    unknown = call(srv, "GET", "/v1/responses/resp_unknown", KEYS["beta"])
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"]
    follow = call(srv, "POST", "/v1/responses", KEYS["beta"], {"model": srv.model, "input": "more",
                                                               "previous_response_id": rid, "max_output_tokens": 2})
    assert follow.status_code == 404
    assert call(srv, "DELETE", f"/v1/responses/{rid}", KEYS["beta"]).status_code == 404
    assert call(srv, "GET", f"/v1/responses/{rid}", KEYS["alpha"]).status_code == 200


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_max_concurrent_requests_refuses_the_rest_and_never_another_tenant(srv):
    gate = srv.gates["gamma"] = threading.Event()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, srv, "gamma", f"question {i}") for i in range(6)]
        _wait(lambda: sum(f.done() for f in futures) == 4, "four refusals")
        assert srv.tenancy.limiter.in_flight("gamma") == 2
        refused = [f.result() for f in futures if f.done()]
        for r in refused:
            assert r.status_code == 429 and r.headers["retry-after"].isdigit()
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert chat(srv, "alpha").status_code == 200  # another tenant is served meanwhile
        m = call(srv, "POST", "/v1/messages", KEYS["gamma"], {"model": srv.model, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]},
                 anthropic=True)
        assert m.status_code == 429 and m.headers["retry-after"] and m.json()["error"]["type"] == "rate_limit_error"
        gate.set()
        served = [f.result() for f in futures if f.result().status_code == 200]
    gate.set()
    assert len(served) == 2
    del srv.gates["gamma"]
    _wait(lambda: srv.tenancy.limiter.in_flight("gamma") == 0, "gamma's slots back")
    assert chat(srv, "gamma").status_code == 200


def test_tokens_per_minute_refuses_once_over_and_serves_after_the_refill(srv):
    now = [1000.0]
    srv.tenancy.limiter.clock = lambda: now[0]  # delta has sent nothing yet: its bucket starts on this clock

    def ask(max_tokens: int = 30) -> httpx.Response:  # 20 prompt tokens + max_tokens
        return call(srv, "POST", "/v1/completions", KEYS["delta"], {"model": srv.model, "prompt": list(range(100, 120)),
                                                                    "max_tokens": max_tokens, "ignore_eos": True})

    assert ask().status_code == 200 and ask().status_code == 200  # 120 -> 70 -> 20
    over = ask()
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert over.headers["retry-after"] == "15"  # 30 tokens short at 2 tokens/s
    assert chat(srv, "alpha").status_code == 200  # not alpha's bucket
    now[0] += 15.0
    assert ask().status_code == 200
    too_big = ask(max_tokens=200)  # more than the whole bucket: never servable
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"


def test_priority_is_capped_by_the_tenants_floor(srv):
    for tenant, asked, engine_priority in [("alpha", 2, 2), ("alpha", -1, 0), ("beta", 1, 3), ("beta", 7, 7)]:
        assert chat(srv, tenant, priority=asked).status_code == 200
        assert srv.calls[-1][:2] == (tenant, engine_priority)
    r = call(srv, "POST", "/v1/responses", KEYS["beta"], {"model": srv.model, "input": "hi", "max_output_tokens": 2,
                                                          "priority": 1, "store": False})
    assert r.status_code == 200 and srv.calls[-1][:2] == ("beta", 3)  # Responses too
    r = chat(srv, "alpha", priority="high")
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_sighup_reloads_the_key_file_atomically(srv):
    previous = signal.getsignal(signal.SIGHUP)
    assert srv.tenancy.install_reload_signal()
    try:
        gate = srv.gates["beta"] = threading.Event()
        before = len(srv.calls)
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(chat, srv, "beta", "still here", max_tokens=4, stream=True)
            _wait(lambda: [c[0] for c in srv.calls[before:]] == ["beta"], "beta's request in the engine")
            srv.path.write_text(key_file_text([KEYS["alpha"], NEW_ALPHA_KEY], with_beta=False))
            os.kill(os.getpid(), signal.SIGHUP)
            _wait(lambda: chat(srv, NEW_ALPHA_KEY).status_code == 200, "the added key")
            assert chat(srv, "beta").status_code == 401  # removed
            gate.set()
            r = stream.result()
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert '"finish_reason": "length"' in r.text or '"finish_reason": "stop"' in r.text
        del srv.gates["beta"]
        srv.path.write_text("tenants:\n  - name: alpha\n    keys: [" + KEYS["alpha"] + "\n")  # malformed YAML
        os.kill(os.getpid(), signal.SIGHUP)
        _wait(lambda: any("key file reload failed" in line for line in srv.log.lines), "the reload error")
        assert chat(srv, NEW_ALPHA_KEY).status_code == 200 and chat(srv, "gamma").status_code == 200
        srv.path.write_text(key_file_text([KEYS["alpha"]]))
        assert srv.tenancy.reload() and chat(srv, "beta").status_code == 200
        assert chat(srv, NEW_ALPHA_KEY).status_code == 401
    finally:
        signal.signal(signal.SIGHUP, previous)
        for gate in srv.gates.values():
            gate.set()  # a failed assert must not leave a request waiting


def _samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_metrics_carry_a_bounded_tenant_label(srv):
    assert call(srv, "GET", "/metrics", KEYS["alpha"]).status_code == 403  # needs the metrics right
    assert call(srv, "GET", "/metrics", None).status_code == 401
    r = call(srv, "GET", "/metrics", KEYS["ops"])
    assert r.status_code == 200
    samples = _samples(r.text)
    tenants = {s.labels["tenant"] for s in samples if "tenant" in s.labels}
    assert tenants <= {"alpha", "beta", "gamma", "delta", "ops", "anonymous"} and "alpha" in tenants

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    assert value("kvserve_tenant_rejections_total", tenant="gamma", reason="concurrency") == 5  # 4 chat + 1 message
    assert value("kvserve_tenant_rejections_total", tenant="delta", reason="tokens") == 1
    assert value("kvserve_tenant_rejections_total", tenant="delta", reason="too_large") == 1
    assert value("kvserve_tenant_rejections_total", tenant="alpha") == 0
    assert value("kvserve_tenant_requests_total", tenant="gamma") == 5  # the 429s never reached the engine
    assert value("kvserve_tenant_prompt_tokens_total", tenant="delta") == 3 * 20
    assert value("kvserve_tenant_generation_tokens_total", tenant="delta") == 3 * 30
    assert any(s.name == "vllm:num_requests_waiting" for s in samples)  # --metrics-compat vllm still there


def test_no_key_digest_or_salt_in_logs_errors_or_metrics(srv):
    tenants = {t.name: t for t in parse_key_file(key_file_text([KEYS["alpha"]])).tenants}
    secrets = [*KEYS.values(), NEW_ALPHA_KEY, *(hashlib.sha256(k.encode()).hexdigest() for k in KEYS.values())]
    secrets += [t.salt for t in tenants.values()] + [t.cache_salt(None) for t in tenants.values()]
    assert GAMMA_SALT in secrets and len(srv.errors) > 20 and srv.log.lines
    metrics = call(srv, "GET", "/metrics", KEYS["ops"]).text
    for where, text in (("logs", "\n".join(srv.log.lines)), ("error bodies", "\n".join(srv.errors)),
                        ("/metrics", metrics)):
        for secret in secrets:
            assert secret not in text, f"a key, digest or salt in the {where}"
    assert any(call[2] and GAMMA_SALT in call[2] for call in srv.calls)  # the salt did reach the engine


# ---- the disk tier, across a restart --------------------------------------------------------------
def _serve_tiny(key_file: Path, disk: Path):
    from bench.server import start_inprocess
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    engine = tiny_engine(tiny_hf_model(tiny_llama_config(max_position_embeddings=1024)), block_size=16,
                         num_blocks=128, max_num_batched_tokens=1024, kv_disk_dir=str(disk), kv_disk_gib=0.05)
    service = build_service(EngineConfig(), ServerConfig(api_key_file=str(key_file), log_stats_interval_s=0),
                            engine=engine)
    return start_inprocess(service.app, service.engine.model_name)


def test_disk_tier_files_of_one_tenant_are_not_restored_for_another(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(key_file_text([KEYS["alpha"]]))
    prompt = [(7 * i) % 120 + 3 for i in range(600)]

    def ask(server, tenant: str, **extra) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                          json={"model": server.model, "prompt": prompt, "max_tokens": 1, **extra}, timeout=120)

    first = _serve_tiny(keys, tmp_path / "kv")
    try:
        assert cached(ask(first, "alpha")) == 0
        r = ask(first, "alpha", priority=1)  # this server schedules fcfs
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    finally:
        first.close()  # the engine writes its cached blocks to the disk tier
    assert list((tmp_path / "kv").glob("*.kvb"))
    second = _serve_tiny(keys, tmp_path / "kv")
    try:
        assert cached(ask(second, "beta")) == 0
        assert cached(ask(second, "alpha")) == 592  # 37 full blocks of 16, restored
    finally:
        second.close()
