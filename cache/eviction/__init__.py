"""Eviction of KV blocks inside a sequence: one policy interface and its registry (``base``),
the policies (``streaming``, ``h2o``), and their config (``config``)."""

from cache.eviction.base import (NO_EVICTION, EvictionPlan, EvictionPolicy, RopeShift, SequenceView, build_policy,
                                 register_policy)
from cache.eviction.config import EVICTION_POLICIES, EvictionConfig
from cache.eviction.h2o import H2OPolicy  # registers "h2o"
from cache.eviction.streaming import StreamingPolicy  # registers "streaming"

__all__ = ["EVICTION_POLICIES", "NO_EVICTION", "EvictionConfig", "EvictionPlan", "EvictionPolicy", "H2OPolicy", "RopeShift",
           "SequenceView", "StreamingPolicy", "build_policy", "register_policy"]
