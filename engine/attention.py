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
    positions ``context_len - (end - start) .. context_len - 1``. ``mask`` is None when the
    chunk is the whole context (plain causal attention over the new tokens only).
    """

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks_needed] long, covering context_len tokens
    mask: torch.Tensor | None  # [q_len, context_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block_id * block_size + offset) of each new token
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] long (padded with 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the pools ``[blocks, block_size, kv_heads, head_dim]``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Context K or V of sequences: ``[..., n_blocks]`` ids -> ``[..., kv_heads, n_blocks * block_size, head_dim]``."""
    blocks = cache[block_ids]  # [..., n, bs, kvh, d]
    shape = blocks.shape
    flat = blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return flat.transpose(-3, -2)


class TorchAttention:
    """Reference backend built on ``scaled_dot_product_attention``; CPU and any GPU."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> ``[T, heads * d]``."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            # All single-token sequences in one batched call: [B, H, 1, d] against [B, kvH, L, d].
            keys = _gather(k_cache, meta.decode_block_table)
            values = _gather(v_cache, meta.decode_block_table)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True,
            ).squeeze(2)
        for chunk in meta.prefills:
            q_c = q[chunk.start:chunk.end].transpose(0, 1)  # [H, q_len, d]
            if chunk.mask is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1)
                values = v[chunk.start:chunk.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q_c, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = _gather(k_cache, chunk.block_ids)[:, :chunk.context_len]
                values = _gather(v_cache, chunk.block_ids)[:, :chunk.context_len]
                o = F.scaled_dot_product_attention(q_c, keys, values, attn_mask=chunk.mask, enable_gqa=True)
            out[chunk.start:chunk.end] = o.transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)
