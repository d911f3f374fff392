"""The model's layers under tensor parallelism: what one rank of ``N`` computes, and the
collectives that make the ranks' partial results whole (Megatron-style, as
``engine.parallel.tensor_parallel`` shards the weights).

- column-parallel: q/k/v (by heads: a rank's query heads and the KV heads they read, GQA
  groups whole) and gate/up hold the rank's slice of the output rows. They need no
  collective: attention runs on the rank's heads and SiLU * up on its MLP columns, so these
  stay the plain matmuls of ``DecoderLayer.use_linear``.
- row-parallel: o_proj and down hold the rank's slice of the input columns and compute a
  partial sum; ``RowParallelLinear`` all-reduces it (o_proj's bias is added by rank 0 only:
  the other ranks' copy is zero).
- vocab-parallel embedding: each rank looks up the ids in its ``ceil(V/N)`` rows (zeros
  elsewhere), then an all-reduce.
- vocab-parallel LM head: each rank computes its slice of the logits, then an all-gather; zero
  rows pad the last slice and the padding is cut off.

A model with a ``ModelShard`` is the same ``LlamaForCausalLM`` / ``DecoderLayer`` as a
single-rank one, its arch the rank's (H/N heads, KV/N KV heads, I/N MLP width, ceil(V/N)
vocabulary rows); only these bindings differ, so both compute the same function up to the
summation order of the all-reduces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

Matmul = Callable[[torch.Tensor], torch.Tensor]


class Collectives(Protocol):
    """The collectives a rank's model runs (``engine.parallel.comm.Group`` provides them)."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class RowParallelLinear:
    """A row-parallel matmul: this rank's partial product, summed over the ranks in place."""

    def __init__(self, mm: Matmul, group: Collectives) -> None:
        self.mm = mm
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.mm(x))


class VocabParallelLMHead:
    """This rank's slice of the logits, gathered from every rank and cut to the vocabulary."""

    def __init__(self, mm: Matmul, group: Collectives, vocab_size: int) -> None:
        self.mm = mm
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_cat(self.mm(hidden), dim=-1)[:, :self.vocab_size]


@dataclass(frozen=True, eq=False)
class ModelShard:
    """One rank's part of a tensor-parallel model: its ``group`` and the full ``vocab_size``."""

    group: Collectives
    vocab_size: int

    def row_parallel(self, mm: Matmul) -> RowParallelLinear:
        return RowParallelLinear(mm, self.group)

    def lm_head(self, mm: Matmul) -> VocabParallelLMHead:
        return VocabParallelLMHead(mm, self.group, self.vocab_size)

    def embed(self, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` from every rank's ``rows`` (this rank's vocabulary slice)."""
        vocab = rows.shape[0]
        local = input_ids - self.group.rank * vocab
        inside = (local >= 0) & (local < vocab)
        x = F.embedding(local.clamp(0, vocab - 1), rows) * inside.unsqueeze(1).to(rows.dtype)
        return self.group.all_reduce(x)
