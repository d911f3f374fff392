"""StreamingLLM (Xiao et al., 2023): attention sinks plus a window of recent tokens."""
from __future__ import annotations

from cache.eviction.base import EvictionPlan, EvictionPolicy, SequenceView, register_policy


@register_policy
class StreamingPolicy(EvictionPolicy):
    """Keep the sink blocks and every block that holds one of the last ``window_tokens`` tokens
    before the step (so at least that many, at most ``block_size - 1`` more); evict the rest.

    Blocks leave in text order, so the evicted ones are always the ``num_evicted_blocks``
    right after the sinks. A rebase happens only when the step's positions would reach the
    context (lazy: see docs/configuration.md for why not at every eviction).
    """

    name = "streaming"

    def plan(self, seq: SequenceView) -> EvictionPlan:
        window = self.config.window_tokens
        assert window is not None
        first_kept = max(0, seq.num_computed_tokens - window) // self.block_size  # text block index
        num_evict = max(0, first_kept - self.sink_blocks - seq.num_evicted_blocks)
        rebase = self.needs_rebase(seq, seq.num_evicted_blocks + num_evict)
        return EvictionPlan(num_evict, rebase)
