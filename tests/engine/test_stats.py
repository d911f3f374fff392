"""Engine stats: counters by name, deltas between snapshots."""
from __future__ import annotations

from engine.stats import EngineCounters


def test_counters_since_are_deltas_by_name():
    before = EngineCounters(10, 4, 1, {"device": 10, "host": 0}, {"device": 4}, {"host": 100}, {})
    now = EngineCounters(15, 6, 1, {"device": 15, "host": 2}, {"device": 6, "host": 1}, {"host": 150},
                         {"host": 64, "disk": 32})
    delta = now.since(before)
    assert (delta.prefix_cache_queries, delta.prefix_cache_hits, delta.num_preemptions) == (5, 2, 0)
    assert delta.tier_queries == {"device": 5, "host": 2}
    assert delta.tier_hits == {"device": 2, "host": 1}  # a tier new since ``before`` counts from 0
    assert delta.tier_bytes_read == {"host": 50} and delta.tier_bytes_written == {"host": 64, "disk": 32}
    assert now.since(EngineCounters()) == now
    assert now.since(now).tier_queries == {} and now.since(before).tier_bytes_read == {"host": 50}  # no zeros sent
    assert EngineCounters(tier_hits={"device": 1, "disk": 0}) == EngineCounters(tier_hits={"disk": 0, "device": 1})
