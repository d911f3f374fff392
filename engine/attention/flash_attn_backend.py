"""``flash_attn``: the flash-attn package's paged kernels (CUDA, fp16/bf16).

Upstream flash-attn 2 reads a paged KV cache only when a page holds a multiple of 256
tokens, and the KV block is the page here (no decoupling), so the backend refuses other
block sizes with the reason. Pure decode steps use ``flash_attn_with_kvcache``; mixed steps
one ``flash_attn_varlen_func`` call over every sequence (decodes are one-row sequences;
flash-attn aligns the causal mask bottom-right, i.e. a chunk sees its whole cached prefix).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register
from engine.attention.metadata import AttentionMetadata, write_kv

FLASH_ATTN_PAGE = 256


@register
class FlashAttention(AttentionBackend):
    name = "flash_attn"
    reads_lengths_in_place = True
    block_mass_refusal = ("flash-attn's kernels return no attention probabilities; run --attention-backend triton "
                          "(or torch)")
    uses_paged_layout = True
    graph_safe_decode = True

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        if device.type != "cuda":
            return "flash-attn runs on CUDA devices only"
        if dtype not in (torch.float16, torch.bfloat16):
            return "flash-attn needs dtype bfloat16 or float16"
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash-attn package is not installed (pip install 'kvserve[gpu]' builds it)"
        if block_size % FLASH_ATTN_PAGE:
            return (f"flash-attn's paged KV needs block_size to be a multiple of {FLASH_ATTN_PAGE} "
                    f"(got {block_size}); set --block-size 256 or use the triton backend")
        return None

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self.varlen = flash_attn_varlen_func
        self.with_kvcache = flash_attn_with_kvcache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        layout = meta.paged
        if layout.num_decodes == num_tokens:
            out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=layout.seq_lens,
                                    block_table=layout.block_table, causal=True)
            return out.reshape(num_tokens, num_heads * head_dim)
        cu_k = F.pad(layout.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        out = self.varlen(q, k_cache, v_cache, layout.query_start, cu_k, layout.max_query_len, layout.max_seq_len,
                          causal=True, block_table=layout.block_table)
        return out.reshape(num_tokens, num_heads * head_dim)

    def describe(self) -> str:
        return "flash-attn paged (flash_attn_with_kvcache / flash_attn_varlen_func)"
