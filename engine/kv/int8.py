"""int8 KV blocks: quantized on write, dequantized where attention reads them.

``Int8KV`` replaces one layer's K (or V) pool: ``data`` int8 ``[blocks, block_size, kv_heads,
head_dim]`` plus ``scale`` float32 ``[blocks, block_size, kv_heads, 2]``: per token and head an
asymmetric range (step, minimum), stored with the block (so the disk tier and block copies carry
it). Asymmetric because keys have a few large channels of one sign: symmetric absmax codes left
98.85% teacher-forced top-1 agreement on SmolLM2 over 2,000 tokens, below the 99% target. Bytes
per token and head: ``head_dim + 8`` instead of ``4 * head_dim`` (fp32): 3.56x the tokens at
head_dim 64. The torch reference backend dequantizes the gathered blocks; the native CPU
decode kernel (engine/kernels/cpu/paged_attention.cpp) reads the codes in place and folds each
(step, minimum) into its dot products. Keys with per-channel ranges (KIVI) were measured and
not adopted: see ``bench/probes/kv_int8.py quality`` and docs/architecture.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import has_op
from engine.platform import huge_pages

SCALE_FIELDS = 2  # (step, minimum) per token and head
SCALE_DTYPE = torch.float32
SCALE_BYTES = SCALE_FIELDS * SCALE_DTYPE.itemsize  # what a token and head costs beyond its int8 codes


@dataclass
class Int8KV:
    data: torch.Tensor  # int8 [blocks, block_size, kv_heads, head_dim]
    scale: torch.Tensor  # float32 [blocks, block_size, kv_heads, 2]: (step, minimum) per token and head
    out_dtype: torch.dtype = torch.float32  # what reads dequantize to (the model's dtype)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], out_dtype: torch.dtype, device: torch.device) -> "Int8KV":
        return cls(huge_pages.zeros_on(device, shape, torch.int8),
                   huge_pages.zeros_on(device, (*shape[:-1], SCALE_FIELDS), SCALE_DTYPE), out_dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., head_dim]`` -> (int8 codes, float32 ``[..., 2]`` = (step, minimum)), per row."""
    x = x.float()
    low = x.amin(dim=-1, keepdim=True)
    step = (x.amax(dim=-1, keepdim=True) - low).clamp_min(1e-8) / 255.0
    codes = torch.round((x - low) / step).clamp_(0, 255) - 128
    return codes.to(torch.int8), torch.cat([step, low], dim=-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((codes.to(torch.float32) + 128.0) * scale[..., :1] + scale[..., 1:]).to(dtype)


def write_int8(cache: Int8KV, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new ``[T, kv_heads, head_dim]`` rows into their slots, quantized (on the CPU in fp32
    by the native ``write_int8_kv``, the same arithmetic in one call instead of ~10 torch ops)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] and has_op("write_int8_kv"):
        torch.ops.kvserve.write_int8_kv(x, cache.data, cache.scale, slot_mapping)
        return
    q, s = quantize(x)
    kv_heads, head_dim = x.shape[1], x.shape[2]
    cache.data.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, q)
    cache.scale.view(-1, kv_heads, 2).index_copy_(0, slot_mapping, s)


def gather_int8(cache: Int8KV, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """As ``attention.gather_kv``, dequantized: ``[num_seqs, kv_heads, length, head_dim]``."""
    kv_heads, head_dim = cache.data.shape[-2], cache.data.shape[-1]
    blocks = dequantize(cache.data.index_select(0, block_ids), cache.scale.index_select(0, block_ids),
                        cache.out_dtype)
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)
