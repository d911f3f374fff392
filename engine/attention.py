"""Paged attention: step metadata and the torch reference backend.

Token layout of a step (built by the ModelRunner): the single-token (decode)
sequences come first, one token each, then each prefill chunk's tokens contiguously.
Every layer first writes the step's new K/V into the paged pool through ``slot_mapping``
and only then attends, so a sequence can attend to its own new tokens and to blocks another
sequence of the same step just filled (a prefix hit on a block computed in this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_quant import Int8KV, gather_int8, write_int8


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
class AttentionMetadata:
    """Built once per step by the ModelRunner and shared by every layer.

    Decoding rows come sorted by context length and split into ``decode_groups`` so that a
    short context is not padded (copied and attended) up to the longest one of the step.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block_id * block_size + offset) of each new token
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the pools ``[blocks, block_size, kv_heads, head_dim]``."""
    if isinstance(k_cache, Int8KV):
        write_int8(k_cache, k, slot_mapping)
        write_int8(v_cache, v, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of K or V of ``num_seqs`` sequences whose blocks are
    ``block_ids`` (``[num_seqs * blocks_per_row]``) -> ``[num_seqs, kv_heads, length, head_dim]``:
    one ``index_select`` copy per call, the rest are views (int8 pools: dequantized)."""
    if isinstance(cache, Int8KV):
        return gather_int8(cache, block_ids, num_seqs, length)
    kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    blocks = cache.index_select(0, block_ids)
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)


class TorchAttention:
    """Reference backend built on ``scaled_dot_product_attention``; CPU and any GPU.

    With ``native_decode`` the single-token rows go to the compiled CPU kernel
    (``torch.ops.kvserve.paged_decode_attention``, see ``engine/kernels``), which reads the
    pool in place instead of gathering a contiguous copy; prefill chunks always use SDPA.
    """

    def __init__(self, native_decode: bool = False) -> None:
        self.native_decode = native_decode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> ``[T, heads * d]``."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        groups = meta.decode_groups
        if len(groups) == 1 and not meta.prefills:  # the common pure-decode step: no scatter
            return self._decode(q, k_cache, v_cache, groups[0]).view(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        for g in groups:
            out[g.start:g.end] = self._decode(q[g.start:g.end], k_cache, v_cache, g)
        for chunk in meta.prefills:
            # 4-D [1, H, q_len, d]: with a batch dimension CPU SDPA takes its flash kernel; 3-D
            # inputs with a mask fall back to the math path (bmm + softmax), 5x slower at 512 x 1000.
            q_c = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.block_ids is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q_c, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = gather_kv(k_cache, chunk.block_ids, 1, chunk.context_len)
                values = gather_kv(v_cache, chunk.block_ids, 1, chunk.context_len)
                o = F.scaled_dot_product_attention(q_c, keys, values, attn_mask=chunk.mask, enable_gqa=True)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
        """Single-token rows in one call: q ``[B, H, d]`` against their contexts -> ``[B, H, d]``."""
        if self.native_decode:
            return torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, g.block_table, g.context_lens,
                                                            q.shape[-1] ** -0.5)
        n = g.end - g.start
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), gather_kv(k_cache, g.block_ids, n, g.length), gather_kv(v_cache, g.block_ids, n, g.length),
            attn_mask=g.mask, enable_gqa=True).squeeze(2)


def make_attention(backend: str, device: torch.device, dtype: torch.dtype) -> TorchAttention:
    """The attention backend for ``ModelConfig.attention_backend``.

    ``torch``: SDPA everywhere. ``native``: SDPA for prefill, the compiled paged kernel for
    decode (CPU, fp32; an error when it cannot be built). ``auto``: ``native`` where it
    applies and builds, ``torch`` otherwise.
    """
    from engine.kernels import load_kernels

    if backend == "torch":
        return TorchAttention()
    applies = device.type == "cpu" and dtype == torch.float32
    if backend == "native":
        if not applies:
            raise ValueError(f"attention_backend 'native' runs on the CPU in float32, not {device.type}/{dtype}")
        if not load_kernels():
            raise ValueError("attention_backend 'native': the paged attention kernel could not be built "
                             "(see the warning above); use 'torch' or 'auto'")
        return TorchAttention(native_decode=True)
    if backend == "auto":
        return TorchAttention(native_decode=applies and load_kernels())
    raise ValueError(f"unknown attention backend {backend!r}")
