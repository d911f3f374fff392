"""server/tenants without a server: the key file's checks, key lookup, salts, and the limiter's
slots, queue and token bucket on an injected clock."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

from server.tenants import KeyFileError, TenantRegistry, parse_key_file
from server.tenants.config import ANONYMOUS_TENANT, Tenant
from server.tenants.limits import RateLimited, TenantLimiter, TooLarge

SECRET = "sk-very-secret-key"


def test_key_file_parses_plain_and_digest_keys_with_defaults():
    digest = hashlib.sha256(b"sk-b").hexdigest()
    f = parse_key_file(f"tenants:\n  - name: a\n    keys: [sk-a]\n  - name: b\n    keys: ['sha256:{digest.upper()}']\n"
                       "    priority: 2\n    allow: [inference, metrics]\n")
    a, b = f.tenants
    assert (a.max_concurrent_requests, a.max_queued_requests, a.tokens_per_minute, a.priority) == (None, 0, None, 0)
    assert a.allow == {"inference", "cache_admin"} and b.allow == {"inference", "metrics"}
    assert f.by_digest[hashlib.sha256(b"sk-b").digest()][0] is b
    assert a.salt and a.salt != b.salt and a.salt == parse_key_file(
        "tenants:\n  - name: a\n    keys: [other]\n").tenants[0].salt  # derived from the name alone


@pytest.mark.parametrize("text,names", [
    (f"tenants:\n  - name: a\n    keys: [{SECRET}\n", "line"),  # broken YAML: where, not what it says
    ("tenants: {}\n", "'tenants'"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n  - name: a\n    keys: [x]\n", "twice"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n  - name: b\n    keys: [{SECRET}]\n", "keys[0]"),
    (f"tenants:\n  - name: a\n    keys: ['sha256:{SECRET}']\n", "keys[0]"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n    max_queued_requests: 3\n", "max_queued_requests"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n    tokens_per_minute: 0\n", "tokens_per_minute"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n    allow: [everything]\n", "allow"),
    (f"tenants:\n  - name: a\n    keys: [{SECRET}]\n    colour: red\n", "colour"),
    (f"tenants:\n  - name: anonymous\n    keys: [{SECRET}]\n", "name"),
])
def test_bad_key_files_name_the_problem_and_never_the_key(text, names):
    with pytest.raises(KeyFileError) as exc:
        parse_key_file(text)
    assert names in str(exc.value) and SECRET not in str(exc.value)


def test_registry_modes_and_reload_keeps_the_old_table_on_a_bad_file(tmp_path, caplog):
    assert TenantRegistry().authenticate(None) is ANONYMOUS_TENANT
    one = TenantRegistry(api_key="k")
    assert one.authenticate("k") is ANONYMOUS_TENANT
    assert one.authenticate("j") is None and one.authenticate(None) is None
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  - name: a\n    keys: [ka]\n")
    reg = TenantRegistry(key_file=path)
    assert reg.authenticate("ka").name == "a" and reg.authenticate("kb") is None
    path.write_text(f"tenants:\n  - name: a\n    keys: [ka, {SECRET}\n")
    assert not reg.reload()
    assert reg.authenticate("ka").name == "a"
    assert "reload failed" in caplog.text and SECRET not in caplog.text
    with pytest.raises(ValueError):
        TenantRegistry(api_key="k", key_file=path)


def test_salts_chain_tenant_then_request_without_collisions():
    t = Tenant("a", salt="s")
    assert ANONYMOUS_TENANT.cache_salt("x") == "x" and ANONYMOUS_TENANT.cache_salt(None) is None
    salts = {t.cache_salt(None), t.cache_salt(""), t.cache_salt("x"), Tenant("b", salt="s:x").cache_salt(None)}
    assert len(salts) == 4 and all(s.startswith("kvserve-tenant:") for s in salts)


def test_concurrency_slots_queue_and_hand_over():
    async def main() -> None:
        limiter = TenantLimiter()
        t = Tenant("a", max_concurrent_requests=1, max_queued_requests=1)
        other = Tenant("b", max_concurrent_requests=1)
        first = await limiter.admit(t, 10)
        waiter = asyncio.ensure_future(limiter.admit(t, 10))
        await asyncio.sleep(0)
        with pytest.raises(RateLimited) as exc:
            await limiter.admit(t, 10)  # the queue is full
        assert exc.value.reason == "queue"
        assert (await limiter.admit(other, 10)).slot  # another tenant's slots are its own
        assert not waiter.done()
        first.release(10)
        second = await waiter
        assert second.slot and limiter.in_flight("a") == 1
        second.release(10)
        assert limiter.in_flight("a") == 0

    asyncio.run(main())


def test_token_bucket_charges_the_most_refunds_the_rest_and_refills_on_the_clock():
    async def main() -> None:
        now = [0.0]
        limiter = TenantLimiter(clock=lambda: now[0])
        t = Tenant("a", tokens_per_minute=600)  # 10 tokens a second
        lease = await limiter.admit(t, 500)  # prompt + max_tokens
        with pytest.raises(RateLimited) as exc:
            await limiter.admit(t, 200)
        assert exc.value.retry_after_s == 10 and exc.value.reason == "tokens"
        lease.release(150)  # used 150 of 500: 350 come back
        held = [await limiter.admit(t, 400)]  # 450 - 400 = 50 left (a lease dropped unreleased refunds it all)
        with pytest.raises(RateLimited):
            await limiter.admit(t, 100)
        now[0] += 5.0  # + 50
        held.append(await limiter.admit(t, 100))
        with pytest.raises(TooLarge):
            await limiter.admit(t, 601)
        dropped = await limiter.admit(Tenant("b", tokens_per_minute=100), 100)
        del dropped  # never ran: refunded whole
        await limiter.admit(Tenant("b", tokens_per_minute=100), 100)

    asyncio.run(main())


def test_a_waiter_that_leaves_gives_up_its_place_and_no_slot_is_lost():
    async def main() -> None:
        limiter = TenantLimiter()
        t = Tenant("a", max_concurrent_requests=1, max_queued_requests=2)
        first = await limiter.admit(t, 1)
        leaving = asyncio.ensure_future(limiter.admit(t, 1))
        staying = asyncio.ensure_future(limiter.admit(t, 1))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        first.release(1)
        second = await staying
        assert leaving.cancelled() and limiter.in_flight("a") == 1
        second.release(1)
        assert limiter.in_flight("a") == 0

    asyncio.run(main())


def test_the_speed_probes_key_file_of_1000_tenants_authenticates_each_key(tmp_path):
    from bench.probes.tenant_overhead import write_key_file

    path = tmp_path / "keys.yaml"
    keys = write_key_file(path, 1000)
    reg = TenantRegistry(key_file=path)
    assert [reg.authenticate(k).name for k in keys] == [f"tenant-{i:05d}" for i in range(1000)]
    assert reg.authenticate(keys[0] + "x") is None
