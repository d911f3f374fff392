"""``native``: the compiled CPU paged decode kernel (engine/kernels) for decode, SDPA for prefill."""
from __future__ import annotations

import torch

from engine.attention.base import register
from engine.attention.metadata import DecodeGroup
from engine.attention.torch_sdpa import TorchAttention
from engine.kernels import has_op
from engine.kv.int4 import Int4KV
from engine.kv.int8 import Int8KV


@register
class NativeAttention(TorchAttention):
    """Decode rows go to ``torch.ops.kvserve.paged_decode_attention``, which reads the pool
    in place instead of gathering a contiguous copy (fp32 pools, or fp16 ones widened as they are
    read); prefill chunks use SDPA. int8 pools
    (``Int8KV``, engine/kv/int8.py) go to ``paged_decode_attention_int8``, which folds the
    per-token-per-head (step, minimum) into the dot products instead of dequantizing rows; int4
    pools (``Int4KV``, engine/kv/int4.py) to ``paged_decode_attention_int4`` (quantized blocks read
    as codes, open blocks from the residual)."""

    name = "native"
    reads_lengths_in_place = True
    supports_native_decode = True  # decode_layer.cpp attends through this kernel (paged_attention.h)
    # decode rows: the kernel adds each block's mass from the softmax it weighs V with; prefill
    # chunks: the torch explicit-softmax path (TorchAttention._forward_with_mass)
    exports_block_mass = True

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        from engine.kernels import load_kernels

        if device.type != "cpu" or dtype != torch.float32:
            return "the native kernel runs on the CPU in float32 only"
        if not load_kernels():
            return "the paged attention kernel could not be built (see the warning above)"
        return None

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
        if isinstance(k_cache, Int4KV):
            if not has_op("paged_decode_attention_int4"):  # a library built before the int4 kernel existed
                return super()._decode(q, k_cache, v_cache, g)
            return torch.ops.kvserve.paged_decode_attention_int4(
                q, k_cache.codes, k_cache.scale, v_cache.codes, v_cache.scale, k_cache.residual, v_cache.residual,
                k_cache.state.slot_of, g.block_table, g.context_lens, q.shape[-1] ** -0.5)
        if isinstance(k_cache, Int8KV):
            return torch.ops.kvserve.paged_decode_attention_int8(
                q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, g.block_table, g.context_lens,
                q.shape[-1] ** -0.5).to(q.dtype)
        return torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, g.block_table, g.context_lens,
                                                        q.shape[-1] ** -0.5)

    def _decode_with_mass(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                          mass: torch.Tensor) -> torch.Tensor:
        if isinstance(k_cache, Int4KV):  # its kernel exports no mass (h2o is refused with int4 pools anyway)
            return super()._decode_with_mass(q, k_cache, v_cache, g, mass)
        scale = q.shape[-1] ** -0.5
        if isinstance(k_cache, Int8KV):
            return torch.ops.kvserve.paged_decode_attention_int8(
                q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, g.block_table, g.context_lens, scale,
                mass).to(q.dtype)
        return torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, g.block_table, g.context_lens, scale,
                                                        mass)

    def describe(self) -> str:
        return "native paged decode kernel + SDPA prefill"
