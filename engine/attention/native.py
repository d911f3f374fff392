"""``native``: the compiled CPU paged decode kernel (engine/kernels) for decode; for prefill, kvserve's own
kernels where the CPU has them (AMX-BF16 tiles for bf16 chunks, AVX2 vectors for fp32 ones), else SDPA."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.attention.base import register
from engine.attention.metadata import AttentionMetadata, DecodeGroup, gather_kv
from engine.attention.torch_sdpa import TorchAttention
from engine.kernels import has_op
from engine.kv.int4 import Int4KV
from engine.kv.int8 import Int8KV


@register
class NativeAttention(TorchAttention):
    """Decode rows go to ``torch.ops.kvserve.paged_decode_attention``, which reads the pool
    in place instead of gathering a contiguous copy (fp32 pools, or fp16 ones widened as they are
    read); prefill chunks use SDPA, or the AMX-BF16 kernel (below). int8 pools
    (``Int8KV``, engine/kv/int8.py) go to ``paged_decode_attention_int8``, which folds the
    per-token-per-head (step, minimum) into the dot products instead of dequantizing rows; int4
    pools (``Int4KV``, engine/kv/int4.py) to ``paged_decode_attention_int4`` (quantized blocks read
    as codes, open blocks from the residual). Prefill chunks go to kvserve's own kernel for the dtype
    they attend in where the CPU runs it (``_prefill``, ``PREFILL_KERNELS``)."""

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

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Prefill chunks on kvserve's kernel for the dtype they attend in (``PREFILL_KERNELS``: bf16
        chunks on the AMX-BF16 tiles, fp32 ones in AVX2 vectors) where the CPU runs it: one call a
        chunk, over the chunk's own keys or its whole context as the pool holds it (gathered, and
        widened or rounded in the kernel), fp32 out; else SDPA's."""
        dtype = self.prefill_dtype or q.dtype
        if not native_prefill_runs(q.shape[-1], dtype):
            return super()._prefill(q, k, v, k_cache, v_cache, meta, out)
        op = getattr(torch.ops.kvserve, PREFILL_KERNELS[dtype].op)
        scale = q.shape[-1] ** -0.5
        for chunk in meta.prefills:
            n = chunk.end - chunk.start
            if chunk.block_ids is None:
                keys, values, prefix = k[chunk.start:chunk.end], v[chunk.start:chunk.end], 0
            else:  # [1, kv_heads, L, d] views of one gathered copy -> [L, kv_heads, d]
                keys = gather_kv(k_cache, chunk.block_ids, 1, chunk.context_len)[0].transpose(0, 1)
                values = gather_kv(v_cache, chunk.block_ids, 1, chunk.context_len)[0].transpose(0, 1)
                prefix = chunk.context_len - n
            out[chunk.start:chunk.end] = op(q[chunk.start:chunk.end], keys, values, prefix, scale)

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
        return "native paged decode kernel"

    def prefill_kernel(self, head_dim: int) -> str:
        dtype = self.prefill_dtype or torch.float32
        kernel = PREFILL_KERNELS[dtype]
        return kernel.name if native_prefill_runs(head_dim, dtype) else f"torch SDPA ({kernel.name} needs {kernel.needs})"

    def prefill_on_tiles(self, head_dim: int) -> bool:
        return self.prefill_dtype == torch.bfloat16 and native_prefill_runs(head_dim, torch.bfloat16)


@dataclass(frozen=True)
class PrefillKernel:
    """One of kvserve's prefill attention kernels (engine/kernels/cpu): the same contract, q
    ``[n, heads, d]`` at positions ``prefix ..`` over keys / values ``[prefix + n, kv_heads, d]``
    -> fp32 ``[n, heads, d]``, for chunks that attend in one dtype."""

    op: str            # torch.ops.kvserve.<op>(q, keys, values, prefix, scale)
    name: str          # for the startup log
    needs: str         # what it needs, for the log where it does not run
    head_dim_multiple: int


PREFILL_KERNELS = {
    # 1.9-3x torch's bf16 flash kernel at a 1,000-token prompt's chunks (prefill_attention.cpp)
    torch.bfloat16: PrefillKernel("prefill_attention", "kvserve's AMX-BF16 kernel",
                                  "AMX-BF16, AVX512-BF16 and a head size that is a multiple of 32, at most 256", 32),
    # torch's fp32 flash kernel was a third of a 1,000-token prefill on AVX2 CPUs (prefill_attention_f32.cpp)
    torch.float32: PrefillKernel("prefill_attention_f32", "kvserve's AVX2 fp32 kernel",
                                 "AVX2, FMA, F16C and a head size that is a multiple of 16, at most 256", 16),
}


@functools.cache
def native_prefill_runs(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether kvserve's prefill kernel for chunks attending in ``dtype`` (``PREFILL_KERNELS``) runs
    here for this head size: the CPU's answer, asked of the kernel library, and the head size the
    kernel takes. Asked once per (head size, dtype) (every layer's prefill asks)."""
    kernel = PREFILL_KERNELS.get(dtype)
    return (kernel is not None and head_dim % kernel.head_dim_multiple == 0 and head_dim <= 256
            and has_op(f"{kernel.op}_supported") and getattr(torch.ops.kvserve, f"{kernel.op}_supported")())
