"""Paged attention step metadata, shared by every backend.

Token layout of a step (built by the ModelRunner): the single-token (decode)
sequences come first, one token each, then each prefill chunk's tokens contiguously.
Every layer first writes the step's new K/V into the paged pool through ``slot_mapping``
and only then attends, so a sequence can attend to its own new tokens and to blocks another
sequence of the same step just filled (a prefix hit on a block computed in this step).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.kv.int4 import Int4KV, gather_int4, write_int4
from engine.kv.int8 import Int8KV, gather_int8, write_int8


@dataclass
class PrefillChunk:
    """One sequence running more than one token this step.

    ``start:end`` are its rows in the flat token batch; its queries sit at absolute
    positions ``context_len - (end - start) .. context_len - 1``. ``block_ids`` and ``mask``
    are None when the chunk is the whole context (plain causal attention over the new tokens
    only); otherwise ``block_ids`` are the blocks holding all ``context_len`` tokens.
    """

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor | None  # [ceil(context_len / block_size)] long
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = may attend


@dataclass
class DecodeGroup:
    """Single-token sequences of similar context length, attended to in one batched call.

    Rows ``start:end`` of the flat batch; each row's context is read with one
    ``index_select`` of whole blocks per layer (a block is one contiguous run of memory,
    far cheaper to copy than its token rows one by one): ``block_ids`` holds each row's
    first ``ceil(length / block_size)`` blocks, row after row, shorter rows padded with
    block 0 (finite data that ``mask`` hides); keys past ``length`` are sliced off as a
    view. ``mask`` is None when every row has exactly ``length`` tokens of context (always
    so for a single stream), which lets SDPA run without a mask.
    """

    start: int
    end: int
    length: int  # longest context in the group
    block_ids: torch.Tensor  # [(end - start) * ceil(length / block_size)] long
    mask: torch.Tensor | None  # [end - start, 1, 1, length] bool, True = may attend
    context_lens: torch.Tensor  # [end - start] long: each row's own context length

    @property
    def block_table(self) -> torch.Tensor:
        """``block_ids`` as one row per sequence: ``[end - start, ceil(length / block_size)]``."""
        return self.block_ids.view(self.end - self.start, -1)


@dataclass
class PagedLayout:
    """Every sequence of the step as one varlen batch over the paged pool, for the kernels
    that read keys and values in place (triton, flash_attn). Built by the runner only for
    backends whose ``uses_paged_layout`` is set.

    Sequences come in the flat token order (decodes first, then prefill chunks): sequence
    ``i`` owns rows ``query_start[i]:query_start[i + 1]`` and has ``seq_lens[i]`` tokens of
    context (its new tokens included: they are written to the pool before attention); its
    queries are the last ``q_len`` positions of that context (causal, bottom-right aligned).
    ``block_table`` rows are padded with block 0 past a sequence's last block (never read:
    every kernel stops at ``seq_lens``). ``max_query_len``/``max_seq_len`` are host ints.
    """

    query_start: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    num_decodes: int  # the first num_decodes sequences have exactly one query row
    max_query_len: int
    max_seq_len: int


@dataclass
class AttentionMetadata:
    """Built once per step by the ModelRunner and shared by every layer.

    Decoding rows come sorted by context length and split into ``decode_groups`` so that a
    short context is not padded (copied and attended) up to the longest one of the step
    (one group only when the backend reads each row's own length in place).
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block_id * block_size + offset) of each new token
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    paged: PagedLayout | None = None
    # H2O (cache/eviction/h2o.py): ``[num_seqs, max_blocks]`` float32, zeros from the runner;
    # a backend that ``exports_block_mass`` adds each sequence's attention probability mass per
    # block-table index, summed over layers, heads and the sequence's query rows. Sequence i is
    # decode row i (decode rows first), then prefill chunk j is sequence ``num_decode_rows + j``.
    block_mass: torch.Tensor | None = None

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(the decode rows, the prefill chunks) as two steps: the first ``n`` rows (every decode
        group) and the rest, its chunks renumbered from row 0. Not for a paged layout.
        ``block_mass`` is split the same way, as views: both halves add into the step's."""
        assert self.paged is None, "a paged layout spans the whole step"
        n = self.decode_groups[-1].end if self.decode_groups else 0
        chunks = [dataclasses.replace(c, start=c.start - n, end=c.end - n) for c in self.prefills]
        mass = self.block_mass
        return (AttentionMetadata(self.slot_mapping[:n], self.decode_groups, [],
                                  block_mass=None if mass is None else mass[:n]),
                AttentionMetadata(self.slot_mapping[n:], [], chunks, block_mass=None if mass is None else mass[n:]))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the pools ``[blocks, block_size, kv_heads, head_dim]``
    (int8 pools: quantized on write; int4 pools: as the step's plan says, engine/kv/int4.py; a float
    pool of another dtype: rounded to it)."""
    if isinstance(k_cache, Int4KV):
        write_int4(k_cache, k, slot_mapping)
        write_int4(v_cache, v, slot_mapping)
        return
    if isinstance(k_cache, Int8KV):
        write_int8(k_cache, k, slot_mapping)
        write_int8(v_cache, v, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of K or V of ``num_seqs`` sequences whose blocks are
    ``block_ids`` (``[num_seqs * blocks_per_row]``) -> ``[num_seqs, kv_heads, length, head_dim]``:
    one ``index_select`` copy per call, the rest are views (int8 and int4 pools: dequantized)."""
    if isinstance(cache, Int4KV):
        return gather_int4(cache, block_ids, num_seqs, length)
    if isinstance(cache, Int8KV):
        return gather_int8(cache, block_ids, num_seqs, length)
    kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    blocks = cache.index_select(0, block_ids)
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)
