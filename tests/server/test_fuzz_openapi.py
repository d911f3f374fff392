"""Schemathesis against the real server, driven by its own ``/openapi.json`` (server/openapi.py).

Every operation in the document gets ``EXAMPLES`` positive (schema-valid) and ``EXAMPLES``
negative (schema-invalid) generated requests, from a fixed seed (the same cases every run), each
through ``case.call_and_validate``: all of schemathesis's default checks (no 5xx, documented
status codes, content types and response schemas, negative data rejected, positive data
accepted, auth enforced, ...) plus ``error_shape``: every 4xx carries the route's error body
(Anthropic's on /v1/messages*, OpenAI's elsewhere), documented status or not. A request that
hangs fails on the client's timeout.

Generated bodies would ask for the context's whole length (``max_tokens`` absent or huge) on a
two-core machine: ``bounded`` clamps the token counts and ``n`` of every case to a few tokens
(types kept, so a negative case stays negative), and points positive cases at the served model
(otherwise nearly all of them would be the 404 of an unknown model and never reach the engine).

Afterwards the server must still answer a plain chat request and hold no KV block: the pins a
generated ``cache_control`` made are deleted through ``/v1/cache`` first (they are meant to
outlive their request), then the core's snapshot must show nothing running and no block used.
"""
from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
requests = pytest.importorskip("requests")

EXAMPLES = 5  # per operation and generation mode (12 took 63 s of the suite)
SEED = 20261204  # the same cases every run
MAX_TOKENS = 4  # the most tokens a generated request may ask for (clamped, see bounded)
# a response slower than this is a hang: generous, as the two cores may be shared with other
# work (a 60 s bound tripped on a request that takes 0.4 s alone, with the load average at 6)
REQUEST_TIMEOUT_S = 120
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "thinking_token_budget",
                 "max_reasoning_tokens")
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                     "/v1/messages/count_tokens")


def bounded(case: Any, model: str) -> None:
    """Clamp a generated body to a short generation (in place)."""
    body = case.body
    if not isinstance(body, dict):
        return
    positive = case.meta is None or case.meta.generation.mode.is_positive
    for field in _TOKEN_FIELDS:
        value = body.get(field)
        # a whole float (1985129.0) is a valid integer to JSON Schema and to pydantic: clamp it too
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 4:  # up to --max-prompts (32) prompts, each run n times
        body["prompt"] = prompt[:4]
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[field] = 2
    if positive and case.operation.path in _GENERATION_PATHS:
        body["model"] = model
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if field in body and body[field] is None:  # null: up to the context's end (2048 tokens here)
                body[field] = MAX_TOKENS
        if case.operation.path == "/v1/responses":
            body.setdefault("max_output_tokens", MAX_TOKENS)
        elif case.operation.path != "/v1/messages/count_tokens":
            body.setdefault("max_tokens", MAX_TOKENS)


@schemathesis.check
def error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx has the route's error body: Anthropic's on /v1/messages*, OpenAI's elsewhere."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    if case.operation.path.startswith("/v1/messages"):
        assert body.get("type") == "error", body
        assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
        assert set(error) >= {"param", "code"}, body
    return None


# What pydantic says when a body breaks the model's schema: a positive (schema-valid) case must
# never get one, or /openapi.json disagrees with the model. A model validator's own rule
# ("Value error, ...") is a semantic check like the ones below.
_SCHEMA_LAYER = ("missing required parameter", "unknown parameter", "the request body is not valid JSON")


@schemathesis.check
def schema_valid_is_semantic(ctx: Any, response: Any, case: Any) -> bool | None:
    """A schema-valid request may still be a 400 (see CONFIG), but only for a rule past the
    schema's reach, never for one the document could state."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    body = response.json()
    message = (body.get("error") or {}).get("message", "")
    assert not message.startswith(_SCHEMA_LAYER), f"the document disagrees with the request model: {body}"
    assert not (message.startswith("invalid value for ") and "Value error," not in message), \
        f"the document disagrees with the request model: {body}"
    return None


# positive_data_acceptance stays on, with 400 among its statuses: kvserve checks much that a
# JSON schema cannot state, so a schema-valid body may be refused for it: a chat template that
# cannot render the turns (roles out of order, a tool result without its call), guided_json or
# a tool's parameters that are no JSON schema, a grammar or regex that does not compile, a stop
# list over --max-stop, turns whose content is all empty. schema_valid_is_semantic keeps the
# schema-level ones out of that allowance. What the document can state it states
# (server/openapi.py: non-empty conversations and prompts, token ids, /tokenize's either-or).
CONFIG = {"checks": {"positive_data_acceptance": {
    "expected-statuses": ["2xx", "3xx", "400", "401", "403", "404", "409", "429"]}}}


def _fuzz(operation: Any, mode: Any, model: str, headers: dict[str, str], session: Any,
          statuses: Counter, engine: Any = None) -> None:
    # the deadline bounds a whole case, its auth probes (up to two replays) included; each request
    # is bounded by REQUEST_TIMEOUT_S already
    # a fixed seed, not derandomize (which seeds from this function's source: every edit here
    # would draw other cases, and their generation time varies several-fold)
    @hypothesis.seed(SEED)
    @hypothesis.settings(max_examples=EXAMPLES, database=None,
                         deadline=timedelta(seconds=5 * REQUEST_TIMEOUT_S),
                         phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # no shrinking: bounded
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        bounded(case, model)
        # the key as an explicit header: schemathesis's ignored_auth check then also sends the
        # case without it and with a wrong one, and expects a 401
        try:
            response = case.call_and_validate(session=session, headers=headers, timeout=REQUEST_TIMEOUT_S,
                                              additional_checks=[error_shape, schema_valid_is_semantic])
        except requests.Timeout:
            stats = getattr(engine, "stats", None)
            raise AssertionError(f"no answer in {REQUEST_TIMEOUT_S}s (a hang?) to {case.as_curl_command()}; engine: "
                                 f"{getattr(engine, 'num_in_flight', '?')} in flight, {stats}") from None
        statuses[(operation.label, mode.value, response.status_code)] += 1

    run()


def test_generated_requests_never_break_the_server(live_server, http):
    started = time.monotonic()
    schema = schemathesis.openapi.from_url(f"{live_server.base_url}/openapi.json",
                                           config=schemathesis.Config.from_dict(CONFIG))
    # both header styles, or a generated x-api-key would take the place of the key on /v1/messages*
    headers = {"Authorization": f"Bearer {live_server.api_key}", "x-api-key": live_server.api_key}
    failures: list[str] = []
    statuses: Counter = Counter()  # (operation, mode, status) -> cases
    seconds: dict[str, float] = {}  # "operation mode" -> time taken
    operations = 0
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            operations += 1
            # an operation without parameters or body has no invalid request to generate
            modes = [schemathesis.GenerationMode.POSITIVE]
            if operation.body or list(operation.iter_parameters()):
                modes.append(schemathesis.GenerationMode.NEGATIVE)
            for mode in modes:
                began = time.monotonic()
                try:
                    _fuzz(operation, mode, live_server.model, headers, session, statuses, live_server.engine)
                except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collected: one report for all
                    failures.append(f"{operation.label} ({mode.value}): {exc}")
                seconds[f"{operation.label} {mode.value}"] = time.monotonic() - began
    elapsed = time.monotonic() - started
    assert operations >= 14, f"only {operations} operations in /openapi.json"
    assert not failures, f"{len(failures)} failing operation(s) after {elapsed:.0f}s:\n\n" + "\n\n".join(failures)
    # the clamps let schema-valid requests through to the engine: each generating route ran some
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert any(label == f"POST {path}" and 200 <= status < 300 for label, _, status in statuses), \
            f"no generated request to {path} was served: {sorted(statuses.items())}"

    # pins are meant to outlive their requests: drop the generated ones, then nothing may be held
    for pin in http.get("/v1/cache").json()["data"]:
        assert http.delete(f"/v1/cache/{pin['hash']}").status_code == 200
    assert live_server.wait_idle(30), f"KV blocks still held after fuzzing: {live_server.engine.stats}"
    r = http.post("/v1/chat/completions", json={"model": live_server.model, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert live_server.wait_idle(30)
    print(f"fuzzed {operations} operations, {sum(statuses.values())} cases in {elapsed:.1f}s")
    for (label, mode, status), n in sorted(statuses.items()):
        print(f"  {label} {mode}: {status} x{n}")
    print("slowest:", ", ".join(f"{k} {v:.1f}s" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])[:6]))
