"""EvictionConfig: validation names the field; the default window is resolved from the context."""
import pytest

from cache import CacheConfig
from cache.eviction import EvictionConfig, build_policy


@pytest.mark.parametrize("fields, named", [
    (dict(kv_eviction="lru"), "kv_eviction"),
    (dict(kv_eviction="h2o"), "kv_budget_tokens"),
    (dict(kv_eviction="h2o", kv_budget_tokens=32, kv_window_tokens=16), "kv_window_tokens"),
    (dict(kv_eviction="streaming", kv_budget_tokens=64), "kv_budget_tokens"),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, kv_recent_tokens=-1), "kv_recent_tokens"),
    (dict(kv_eviction="h2o", kv_budget_tokens=48, kv_recent_tokens=16), "kv_budget_tokens 48"),
    (dict(kv_eviction="streaming", kv_sink_tokens=-1), "kv_sink_tokens"),
    (dict(kv_eviction="streaming", kv_window_tokens=0), "kv_window_tokens"),
    (dict(kv_eviction="streaming", kv_max_request_tokens=True), "kv_max_request_tokens"),
])
def test_bad_fields_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        CacheConfig(**fields)


def test_the_default_window_is_half_of_what_fits_and_a_window_too_big_is_refused():
    config = EvictionConfig("streaming", sink_tokens=4, block_size=16).resolve(8192, 512)
    assert config.sink_blocks == 1 and config.window_tokens == (8192 - 16 - 15 - 512) // 2 // 16 * 16
    assert config.max_held_tokens <= 8192
    with pytest.raises(ValueError, match="kv_window_tokens 8000"):
        EvictionConfig("streaming", window_tokens=8000, block_size=16).resolve(8192, 512)
    with pytest.raises(ValueError, match="no window"):
        EvictionConfig("streaming", block_size=16).resolve(256, 256)
    assert build_policy(EvictionConfig().resolve(8192, 512)) is None
    with pytest.raises(ValueError, match="resolved"):
        build_policy(EvictionConfig("streaming"))


def test_h2o_resolves_its_recent_tokens_and_caps_a_request_at_the_context():
    config = EvictionConfig("h2o", sink_tokens=4, block_size=16, budget_tokens=256).resolve(1024, 64)
    assert config.budget_blocks == 16 and config.recent_tokens == (16 - 1 - 1) // 2 * 16
    assert config.max_request_tokens == 1024  # keys keep their text positions: no run past the context
    assert config.max_held_tokens == 256 + 64
    assert EvictionConfig("h2o", block_size=16, budget_tokens=256, max_request_tokens=300).resolve(1024, 64) \
        .max_request_tokens == 300
    assert build_policy(config).name == "h2o"
