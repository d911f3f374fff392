"""The eviction policy interface, its plan, and the registry of policies.

A policy decides, for one sequence at one step, which of its kept blocks fall out and whether
the kept keys must be re-rotated; ``KVCacheManager.allocate_slots`` checks that the whole plan
fits before it changes anything, then applies it (cache/kv_cache_manager.py).

The positions a sequence's keys were rotated at: its first ``sink_blocks`` blocks (never
evicted) at their text positions; every later kept token ``t`` at ``t - position_shift``. A
*rebase* sets ``position_shift`` to the evicted tokens, so the kept tokens sit at contiguous
positions after the sinks (the cache's positions, as in StreamingLLM); the kept keys after
the sinks are then rotated back by the difference (``RopeShift``, applied by the engine to the
pool's tensors before the step's forward pass).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from cache.eviction.config import EvictionConfig


@dataclass(frozen=True)
class SequenceView:
    """What a policy reads of one sequence at the start of a step (text = all of its tokens)."""

    num_computed_tokens: int  # text tokens whose KV was computed (evicted ones included)
    num_new_tokens: int  # text tokens this step computes
    num_evicted_blocks: int  # blocks evicted so far; they followed the sinks, contiguously
    position_shift: int  # see the module docstring
    # h2o: the accumulated attention mass of each kept block, in block-table order (the blocks
    # held, then this step's prefix hits at 0)
    block_mass: tuple[float, ...] = ()


@dataclass(frozen=True)
class EvictionPlan:
    """``num_evict``: the kept blocks right after the sinks to drop now (streaming evicts the
    oldest blocks of its window). ``rebase``: re-rotate so positions are contiguous again.
    ``indices`` (h2o): the kept blocks to drop, by block-table index (ascending, past the sinks,
    never the last one); when given, ``num_evict`` is their count."""

    num_evict: int = 0
    rebase: bool = False
    indices: tuple[int, ...] = ()


NO_EVICTION = EvictionPlan()


@dataclass(frozen=True)
class RopeShift:
    """A change the engine makes to the pool's tensors before the step runs: first copy each
    ``(src, dst)`` block (every layer's K and V: copy on write of a block another holder
    shares), then rotate the keys of ``block_ids`` (in every layer) back by ``delta`` positions."""

    block_ids: tuple[int, ...]
    delta: int
    copies: tuple[tuple[int, int], ...] = ()


class EvictionPolicy(ABC):
    """One way of evicting blocks inside a sequence. Stateless per sequence: the manager keeps
    the state (``SequenceView``) and applies the plans."""

    name: str

    def __init__(self, config: EvictionConfig) -> None:
        if config.max_positions is None:
            raise ValueError("an eviction policy needs a resolved EvictionConfig (EvictionConfig.resolve)")
        self.config = config
        self.block_size = config.block_size
        self.sink_blocks = config.sink_blocks

    @abstractmethod
    def plan(self, seq: SequenceView) -> EvictionPlan:
        """What to evict before this step's tokens are computed."""

    # Evicts only the blocks right after the sinks (so kept block j past the sinks is text block
    # j + evicted); False: any kept block past the sinks, named by ``EvictionPlan.indices``.
    contiguous: bool = True
    # Reads ``SequenceView.block_mass``: the attention backend must export per-block attention mass.
    needs_block_mass: bool = False

    @property
    def max_hit_tokens(self) -> int:
        """Prefix-cache hits go at most this far, so that a sequence's first step never needs a
        rebase (whose copies would read blocks another request computes in that very step)."""
        return max(0, self.config.max_positions - self.config.max_chunk_tokens)  # type: ignore[operator]

    def needs_rebase(self, seq: SequenceView, num_evicted_blocks: int) -> bool:
        """True when this step's last position id would reach the context under the current shift."""
        end = seq.num_computed_tokens + seq.num_new_tokens
        evicted_tokens = num_evicted_blocks * self.block_size
        return evicted_tokens > seq.position_shift and end - seq.position_shift > self.config.max_positions


_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    _REGISTRY[cls.name] = cls
    return cls


def build_policy(config: EvictionConfig | None) -> EvictionPolicy | None:
    """The policy ``config`` names (None for ``none``); ``config`` must be resolved."""
    if config is None or not config.enabled:
        return None
    if config.policy not in _REGISTRY:
        raise ValueError(f"no eviction policy {config.policy!r} is registered (cache/eviction/__init__.py imports them)")
    return _REGISTRY[config.policy](config)
