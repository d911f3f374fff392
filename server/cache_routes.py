"""Prompt-cache retention over HTTP: request fields -> ``CachePolicy``, and the pin admin routes.

* ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` (Anthropic style) on a chat
  message or one of its text parts marks a breakpoint: the prompt tokens up to it are pinned in
  the device pool for the TTL. With several breakpoints the last one counts (it covers the
  others); its TTL is the longest given.
* ``prompt_cache_retention: "in_memory" | "24h"`` (OpenAI): ``24h`` writes the prompt's full
  blocks through to the disk tier, protected from its LRU for 24 hours (a 400 if the server runs
  without ``--kv-disk-dir``). ``prompt_cache_key`` is recorded in the policy for routers.
* ``GET /v1/cache`` lists pins; ``DELETE /v1/cache/{hash}`` unpins. Both behind the API key,
  with a key file the ``cache_admin`` right (403 without), and scoped to the caller's tenant:
  another tenant's pin is not listed, and deleting it is the 404 of an unknown hash.

The pinned prefix length is measured, not guessed: the chat template renders the messages up
to the breakpoint, and the pin covers the tokens that rendering shares with the full prompt.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any, Literal

from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict

from cache.pins import PIN_TTL_SECONDS, RETENTION_SECONDS
from kvtypes.cache_policy import CachePolicy
from kvtypes.sampling_params import SamplingParams
from engine.tokenizer import TemplateError, encode_chat
from server.errors import APIError, bad_request
from server.tenants import current_tenant

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
UNPIN_WAIT_S = 2.0  # how long DELETE waits for the core's snapshot to drop the pin


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


def _breakpoint(messages: list[Any]) -> tuple[int, int | None, str] | None:
    """(message index, part index or None for the whole message, longest ttl) of the last
    cache_control breakpoint in prompt order, or None."""
    found: tuple[int, int | None] | None = None
    ttls: list[str] = []
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.cache_control is not None:
                found = (i, j)
                ttls.append(part.cache_control.ttl)
        if message.cache_control is not None:  # covers the whole message: after its parts
            found = (i, None)
            ttls.append(message.cache_control.ttl)
    if found is None:
        return None
    return found[0], found[1], max(ttls, key=lambda t: PIN_TTL_SECONDS[t])


def _pin_tokens(tokenizer: Any, messages: list[Any], rendered: list[dict[str, str]], prompt_ids: list[int],
                at: tuple[int, int | None]) -> int:
    """Prompt tokens shared by the full prompt and the rendering of the messages up to ``at``
    (a request message index and part). ``rendered`` has one message per request message, after
    the system message ``render_messages`` may put first (the tool listing): request message i is
    rendered message i + that offset."""
    index, part = at
    shift = len(rendered) - len(messages)
    assert shift in (0, 1), "render_messages puts at most one message before the request's"
    end = index + shift
    prefix = [dict(m) for m in rendered[:end + 1]]
    if part is not None:
        prefix[end]["content"] = "".join(p.text for p in messages[index].content[:part + 1])
    try:
        ids = encode_chat(tokenizer, prefix, add_generation_prompt=False)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    n = 0
    for a, b in zip(ids, prompt_ids):
        if a != b:
            break
        n += 1
    return n


def chat_cache_policy(body: Any, tokenizer: Any, rendered: list[dict[str, str]], prompt_ids: list[int],
                      has_disk_tier: bool) -> CachePolicy | None:
    """The cache policy a chat request asks for (None: plain prefix caching)."""
    pin_tokens, ttl = 0, 0.0
    at = _breakpoint(body.messages)
    if at is not None:
        pin_tokens = _pin_tokens(tokenizer, body.messages, rendered, prompt_ids, at[:2])
        ttl = PIN_TTL_SECONDS[at[2]]
    return _policy(body, pin_tokens, ttl, has_disk_tier)


def completion_cache_policy(body: Any, has_disk_tier: bool) -> CachePolicy | None:
    return _policy(body, 0, 0.0, has_disk_tier)


def _policy(body: Any, pin_tokens: int, ttl: float, has_disk_tier: bool) -> CachePolicy | None:
    retention = RETENTION_SECONDS[body.prompt_cache_retention or "in_memory"]
    if retention is not None and not has_disk_tier:
        raise bad_request("prompt_cache_retention '24h' needs the disk tier: start the server with --kv-disk-dir",
                          "prompt_cache_retention")
    if not pin_tokens and retention is None and body.prompt_cache_key is None:
        return None
    return CachePolicy(pin_tokens=pin_tokens, pin_ttl_s=ttl if pin_tokens else 0.0, retention_s=retention,
                       cache_key=body.prompt_cache_key)


def has_disk_tier(engine: Any) -> bool:
    """Whether the engine core runs with a disk tier (``EngineInfo``, fixed when the core started)."""
    return bool(getattr(getattr(engine, "info", None), "has_disk_tier", False))


def with_policy(params: SamplingParams, policy: CachePolicy | None) -> SamplingParams:
    return params if policy is None else dataclasses.replace(params, cache_policy=policy)


def add_cache_routes(app: FastAPI, engine: Any, authorized: Any, tenancy: Any) -> None:
    """``GET /v1/cache`` and ``DELETE /v1/cache/{hash}`` (``engine``: the EngineClient).

    Both answer from the latest ``StepStats`` snapshot's pin list (the core sends one after every
    step and, while idle, whenever its pins change); a delete is a fire-and-forget ``Unpin``
    command, applied by the core at its next scheduling step or idle poll; the answer waits (up
    to ``UNPIN_WAIT_S``) for a snapshot without the pin."""
    def snapshot() -> Any:
        stats = engine.stats
        if stats is None:
            raise APIError(503, "the engine has not reported its KV cache yet", "service_unavailable_error", None,
                           "no_kv_cache")
        return stats

    def own_pins() -> list[Any]:
        tenant = current_tenant()
        return [p for p in snapshot().pins if tenancy.owns(tenant, p.tenant)]

    @app.get("/v1/cache", dependencies=[Depends(authorized)])
    async def list_cache() -> dict:
        stats = snapshot()
        age = max(0.0, time.monotonic() - stats.time)
        data = [{"hash": p.hash, "tokens": p.num_tokens, "blocks": p.num_blocks, "ttl_seconds": p.ttl_s,
                 "ttl_left_seconds": round(max(0.0, p.ttl_left_s - age), 3), "salt_id": p.salt_id}
                for p in own_pins()]
        data = [d for d in data if d["ttl_left_seconds"] > 0]
        return {"object": "list", "data": data, "pinned_blocks": sum(p["blocks"] for p in data),
                "max_pinned_blocks": engine.info.max_pinned_blocks, "created": int(time.time())}

    @app.delete("/v1/cache/{block_hash}", dependencies=[Depends(authorized)])
    async def unpin(block_hash: str) -> dict:
        if not _HASH_RE.match(block_hash) or all(p.hash != block_hash for p in own_pins()):
            raise APIError(404, "no pinned prefix has this hash", "invalid_request_error", "hash", "not_found")
        engine.unpin(block_hash)
        # The core applies it at its next step or idle poll and then reports its pins; wait
        # (briefly, off nothing: the event loop keeps serving) so that a listing after this
        # answer no longer shows the pin.
        deadline = time.monotonic() + UNPIN_WAIT_S
        while any(p.hash == block_hash for p in snapshot().pins) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return {"hash": block_hash, "object": "cache.pin", "deleted": True}
