"""Paged attention: step metadata and the torch reference backend.

Token layout of a step (built by the ModelRunner): the ``num_decodes`` single-token
sequences come first, one token each, then each prefill chunk's tokens contiguously.
Every layer first writes the step's new K/V into the paged pool through ``slot_mapping``
and only then attends, so a sequence can attend to its own new tokens and to blocks another
sequence of the same step just filled (a prefix hit on a block computed in this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
class AttentionMetadata:
    """Built once per step by the ModelRunner and shared by every layer.

    Decode context is read with one ``index_select`` of whole blocks per layer (a block is
    one contiguous run of memory, far cheaper to copy than its token rows one by one):
    ``decode_block_ids`` holds each decoding sequence's first ``ceil(decode_len /
    block_size)`` blocks, row after row, shorter rows padded with block 0 (finite data that
    ``decode_mask`` hides); keys past ``decode_len`` are sliced off as a view. ``decode_mask``
    is None when every decoding sequence has the same context length (always so for a
    single stream), which lets SDPA run without a mask.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block_id * block_size + offset) of each new token
    num_decodes: int
    decode_block_ids: torch.Tensor | None  # [num_decodes * blocks_per_row] long
    decode_len: int  # longest decode context this step (0 without decodes)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, decode_len] bool, True = may attend
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the pools ``[blocks, block_size, kv_heads, head_dim]``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of K or V of ``num_seqs`` sequences whose blocks are
    ``block_ids`` (``[num_seqs * blocks_per_row]``) -> ``[num_seqs, kv_heads, length, head_dim]``:
    one ``index_select`` copy per call, the rest are views."""
    kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    blocks = cache.index_select(0, block_ids)
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)


class TorchAttention:
    """Reference backend built on ``scaled_dot_product_attention``; CPU and any GPU."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> ``[T, heads * d]``."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        nd = meta.num_decodes
        if nd:
            # All single-token sequences in one batched call: [B, H, 1, d] against [B, kvH, L, d].
            decoded = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), gather_kv(k_cache, meta.decode_block_ids, nd, meta.decode_len),
                gather_kv(v_cache, meta.decode_block_ids, nd, meta.decode_len), attn_mask=meta.decode_mask,
                enable_gqa=True,
            )
            if not meta.prefills:  # a pure decode step: no scatter into a shared output
                return decoded.reshape(nd, num_heads * head_dim)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decoded.squeeze(2)
        for chunk in meta.prefills:
            q_c = q[chunk.start:chunk.end].transpose(0, 1)  # [H, q_len, d]
            if chunk.block_ids is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1)
                values = v[chunk.start:chunk.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q_c, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = gather_kv(k_cache, chunk.block_ids, 1, chunk.context_len)[0]
                values = gather_kv(v_cache, chunk.block_ids, 1, chunk.context_len)[0]
                o = F.scaled_dot_product_attention(q_c, keys, values, attn_mask=chunk.mask, enable_gqa=True)
            out[chunk.start:chunk.end] = o.transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)
