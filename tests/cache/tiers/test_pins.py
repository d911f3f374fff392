"""cache_control pins on the real engine (tiny random Llama), with an injected clock."""
from __future__ import annotations

import random

import pytest

from cache.hashing import hash_full_blocks
from kvtypes.cache_policy import CachePolicy
from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def pinned(tokens: int, ttl: float = 300.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                          cache_policy=CachePolicy(pin_tokens=tokens, pin_ttl_s=ttl), **kw)


PLAIN = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def device_hit(engine, tokens: list[int]) -> int:
    return engine.kv_cache.get_computed_blocks(tokens + [5])[1]


def make(hf_model, **kw):
    engine = tiny_engine(hf_model, block_size=BS, num_blocks=32, max_num_batched_tokens=64, **kw)
    clock = Clock()
    engine.kv_cache.clock = clock
    return engine, clock


def assert_idle(engine) -> None:
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0


def test_pin_survives_a_flood_refreshes_on_hit_and_expires(hf_model):
    engine, clock = make(hf_model)
    a, b = prompt(1, 20), prompt(2, 20)
    out_a = engine.generate([a], pinned(20))[0]
    out_b = engine.generate([b], PLAIN)[0]
    assert out_a.num_cached_tokens == 0
    pins = engine.kv_cache.list_pins()
    assert [(p.num_tokens, p.num_blocks) for p in pins] == [(20, 5)]
    assert pins[0].hash == hash_full_blocks(a, BS)[-1].hex()
    assert engine.kv_cache.num_pinned_blocks == 5

    # A flood of distinct prompts totalling 10x the pool (32 blocks x 4 tokens = 128 tokens).
    flood = [prompt(100 + i, 40) for i in range(32)]
    assert sum(map(len, flood)) >= 10 * 32 * BS
    engine.generate(flood, PLAIN)
    assert device_hit(engine, a) == 20  # pinned: still resident
    assert device_hit(engine, b) == 0  # unpinned: evicted
    del out_b

    # A hit refreshes the TTL: without it the pin would end at 1300.
    clock.now += 200
    assert engine.generate([a + [9, 9, 9, 9, 9]], PLAIN)[0].num_cached_tokens == 20
    clock.now += 200  # 1400: past the original expiry, within the refreshed one (1500)
    engine.generate([prompt(7, 10)], PLAIN)  # a step runs the expiry check
    assert len(engine.kv_cache.list_pins()) == 1
    clock.now += 200
    assert engine.kv_cache.list_pins() == []  # listing hides it at once
    engine.generate([prompt(8, 10)], PLAIN)
    assert engine.kv_cache.num_pinned_blocks == 0
    assert_idle(engine)


def test_cap_holds_and_oldest_pin_moves_to_the_disk_tier(hf_model, tmp_path):
    engine, clock = make(hf_model, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)  # cap: 0.25 * 32 = 8 blocks
    prompts = [prompt(10 + i, 12) for i in range(4)]  # 3 blocks each
    writes = []
    for p in prompts:
        clock.now += 1
        writes.append(engine.generate([p], pinned(12))[0].num_cache_write_tokens)
        assert engine.kv_cache.num_pinned_blocks <= 8
    assert writes == [12, 12, 12, 12]
    live = {p.hash for p in engine.kv_cache.list_pins()}
    assert live == {hash_full_blocks(p, BS)[-1].hex() for p in prompts[2:]}
    engine.offloader.tier.flush(10)
    for p in prompts[:2]:  # demoted pins were written through to the next tier
        assert all(engine.offloader.tier.contains(h) for h in hash_full_blocks(p, BS))
    # Pinning the same prefix again refreshes instead of writing.
    assert engine.generate([prompts[3]], pinned(12))[0].num_cache_write_tokens == 0
    # A pin larger than the cap is not taken (nor an error).
    assert engine.generate([prompt(50, 40)], pinned(40))[0].num_cache_write_tokens == 0
    # DELETE /v1/cache/{hash} path: unpin by hash, applied at the next step.
    key = hash_full_blocks(prompts[3], BS)[-1].hex()
    assert engine.kv_cache.request_unpin(key)
    assert not engine.kv_cache.request_unpin(key)
    assert key not in {p.hash for p in engine.kv_cache.list_pins()}
    engine.generate([prompt(9, 5)], PLAIN)
    assert engine.kv_cache.num_pinned_blocks == 3
    clock.now += 10_000
    engine.generate([prompt(9, 5)], PLAIN)
    assert_idle(engine)
    engine.close()


def test_pins_never_starve_a_request_that_needs_the_whole_pool(hf_model):
    engine, clock = make(hf_model, kv_pin_fraction=0.25)
    for i in range(3):
        clock.now += 1
        engine.generate([prompt(20 + i, 12)], pinned(12))
    assert engine.kv_cache.num_pinned_blocks == 6
    # 100 + 24 tokens = 31 blocks of a 32-block pool: only possible if the pins give way.
    big = engine.generate([prompt(30, 100)], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert big.finish_reason == "length" and len(big.token_ids) == 24
    assert engine.kv_cache.num_pinned_blocks < 6
    clock.now += 10_000
    engine.generate([prompt(9, 5)], PLAIN)
    assert_idle(engine)


def test_pin_is_taken_when_prefill_completes_not_at_finish(hf_model):
    """A long generation's prompt is pinned (and counted as written) from its first token on, once."""
    engine, _ = make(hf_model)
    a = prompt(40, 20)
    rid = engine.add_request(a, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                               cache_policy=CachePolicy(pin_tokens=16, pin_ttl_s=300.0)))
    request = engine.scheduler.requests[rid]
    while request.num_output_tokens == 0:
        assert not engine.kv_cache.list_pins()
        engine.step()
    assert request.num_output_tokens == 1 and not request.status.is_finished
    pins = engine.kv_cache.list_pins()
    assert [p.num_tokens for p in pins] == [16] and request.num_cache_write_tokens == 16
    while engine.has_unfinished():
        engine.step()
    assert [p.num_tokens for p in engine.kv_cache.list_pins()] == [16]  # not taken twice
    engine.kv_cache.request_unpin(pins[0].hash)
    engine.kv_cache.expire_pins()
    assert_idle(engine)
