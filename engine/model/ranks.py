"""The processes that compute the model, as the engine drives them: ``ModelRanks``.

The engine (rank 0) talks to one interface whatever the process layout: the model announces
each step to the other ranks before it computes (``announce_forward``, ``announce_logits``),
the KV tiers copy blocks through ``block_copier``, the core watches for a dead rank
(``watch``) and stops them all (``close``). This base class is a single rank, and the rank
processes of a tensor-parallel group also see this (they run what rank 0 announces); rank 0 of
a group holds ``engine.parallel.tensor_parallel.TensorParallelRanks``.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.attention import AttentionMetadata
from engine.kv.transfer import BlockCopier


class ModelRanks:
    """A single rank: nothing to announce, watch or stop; tier copies read the local pool."""

    def announce_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         kv_caches: list) -> None:
        """Before this rank runs a forward pass: have the other ranks run the same one."""

    def announce_logits(self, hidden: torch.Tensor) -> None:
        """Before this rank runs the LM head: have the other ranks run it on the same rows."""

    def block_copier(self, kv_caches: list) -> BlockCopier:
        """The KV tiers' block copier (``engine.kv.transfer.BlockCopier``'s interface) over the pool
        of every rank."""
        return BlockCopier(kv_caches)

    def watch(self, on_lost: Callable[[int, int | None], None]) -> bool:
        """Call ``on_lost(rank, exitcode)`` (from a daemon thread) when another rank's process ends
        while the group is open; False when there is no other rank to watch."""
        return False

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
