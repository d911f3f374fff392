"""H2O (Zhang et al., 2023, "Heavy-Hitter Oracle"), at block granularity: keep the sinks, the
recent tokens and the blocks that received the most attention; evict the rest."""
from __future__ import annotations

from cache.eviction.base import EvictionPlan, EvictionPolicy, SequenceView, register_policy


@register_policy
class H2OPolicy(EvictionPolicy):
    """Before a step, a sequence holds at most ``budget_blocks`` blocks (the open one included).
    Over that, it evicts the kept blocks with the least accumulated attention mass (summed over
    layers, heads and every query row since the block was written: ``SequenceView.block_mass``),
    never a sink block, a block holding one of the last ``recent_tokens`` computed tokens, or the
    last block. Ties go to the oldest block.

    Whole blocks leave, so the pool never fragments: the block table stays a list of whole
    blocks and the kernels attend over the kept ones (holes in the text, not in the table).
    Keys stay rotated at their text positions: no rebase, and the context bounds the request.
    """

    name = "h2o"
    contiguous = False
    needs_block_mass = True

    def plan(self, seq: SequenceView) -> EvictionPlan:
        bs = self.block_size
        held = seq.num_computed_tokens - seq.num_evicted_blocks * bs  # tokens in the kept blocks
        num_kept = -(-held // bs)
        over = num_kept - self.config.budget_blocks
        if over <= 0:
            return EvictionPlan()
        recent = self.config.recent_tokens or 0
        # kept index of the block holding the first recent token (the last block at least)
        first_recent = min(num_kept - 1, max(0, held - recent) // bs)
        candidates = list(range(self.sink_blocks, first_recent))
        mass = seq.block_mass
        candidates.sort(key=lambda j: (mass[j] if j < len(mass) else 0.0, j))
        chosen = tuple(sorted(candidates[:over]))
        return EvictionPlan(len(chosen), False, chosen)

    @property
    def max_hit_tokens(self) -> int:
        """Positions are text positions and the context bounds the request: hits go all the way."""
        return self.config.max_positions  # type: ignore[return-value]

    def needs_rebase(self, seq: SequenceView, num_evicted_blocks: int) -> bool:
        return False
