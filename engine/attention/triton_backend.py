"""``triton``: the paged kernels of ``engine/kernels/triton`` for decode and prefill alike."""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, register
from engine.attention.metadata import AttentionMetadata, write_kv


@register
class TritonAttention(AttentionBackend):
    """Decode rows through ``paged_decode`` (split-K planned from the decode group's longest
    context, which the CUDA-graph runner fixes to the model's context length so that a
    captured graph's split count never changes); prefill chunks through ``paged_extend``
    over their cached prefix blocks plus themselves. int8 pools (``Int8KV``) are read as codes
    and dequantized inside both kernels. With ``meta.block_mass`` set (H2O) both kernels also
    write each tile's softmax sums per block, which become the mass per block (same outputs)."""

    name = "triton"
    reads_lengths_in_place = True
    exports_block_mass = True
    uses_paged_layout = True
    graph_safe_decode = True
    kv_cache_dtypes = ("auto", "int8", "int4")

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        from engine.kernels.triton import triton_unavailable

        return triton_unavailable(device.type)

    def __init__(self) -> None:
        from engine.kernels.triton import paged_attention

        self.kernels = paged_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        layout = meta.paged
        scale = head_dim ** -0.5
        nd = layout.num_decodes
        mass = meta.block_mass  # rows in the layout's sequence order: decodes, then chunks
        if nd == num_tokens:  # pure decode (the graph-captured case)
            g = meta.decode_groups[0]
            out = self.kernels.paged_decode(q, k_cache, v_cache, layout.block_table, layout.seq_lens, scale,
                                            max_len=g.length, block_mass=mass)
            return out.reshape(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.kernels.paged_decode(q[:nd], k_cache, v_cache, layout.block_table[:nd],
                                                 layout.seq_lens[:nd], scale, max_len=meta.decode_groups[0].length,
                                                 block_mass=None if mass is None else mass[:nd])
        self.kernels.paged_extend(q, k_cache, v_cache, layout.block_table, layout.query_start, layout.seq_lens,
                                  out, scale, seq_offset=nd, num_seqs=layout.seq_lens.shape[0] - nd,
                                  max_query_len=layout.max_query_len, block_mass=mass)
        return out.view(num_tokens, num_heads * head_dim)

    def describe(self) -> str:
        return "triton paged decode (split-K) + paged prefill/extend"
