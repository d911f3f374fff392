"""EvictionConfig: validation names the field; the default window is resolved from the context."""
import pytest

from cache import CacheConfig
from cache.eviction import EvictionConfig, build_policy


@pytest.mark.parametrize("fields, named", [
    (dict(kv_eviction="h2o"), "kv_eviction"),
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
