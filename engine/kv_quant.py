"""int8 KV blocks: quantized on write, dequantized where attention reads them.

``Int8KV`` replaces one layer's K (or V) pool: ``data`` int8 ``[blocks, block_size, kv_heads,
head_dim]`` plus ``scale`` float32 ``[blocks, block_size, kv_heads, 1]``, one symmetric scale per
token and head (absmax / 127), stored with the block (so the disk tier and block copies carry
it). Bytes per token and head: ``head_dim + 4`` instead of ``4 * head_dim`` (fp32): 3.76x the
tokens at head_dim 64. Attention dequantizes the gathered blocks (torch reference path); the
native CPU decode kernel does not read int8 yet, so ``--kv-cache-dtype int8`` runs the torch
backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8KV:
    data: torch.Tensor  # int8 [blocks, block_size, kv_heads, head_dim]
    scale: torch.Tensor  # float32 [blocks, block_size, kv_heads, 1]
    out_dtype: torch.dtype = torch.float32  # what reads dequantize to (the model's dtype)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], out_dtype: torch.dtype, device: torch.device) -> "Int8KV":
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros((*shape[:-1], 1), dtype=torch.float32, device=device), out_dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., head_dim]`` -> (int8 codes, float32 scale ``[..., 1]``), symmetric per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def write_int8(cache: Int8KV, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new ``[T, kv_heads, head_dim]`` rows into their slots, quantized."""
    q, s = quantize(x)
    kv_heads, head_dim = x.shape[1], x.shape[2]
    cache.data.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, q)
    cache.scale.view(-1, kv_heads, 1).index_copy_(0, slot_mapping, s)


def gather_int8(cache: Int8KV, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """As ``attention.gather_kv``, dequantized: ``[num_seqs, kv_heads, length, head_dim]``."""
    kv_heads, head_dim = cache.data.shape[-2], cache.data.shape[-1]
    blocks = cache.data.index_select(0, block_ids).to(cache.out_dtype)
    blocks = blocks * cache.scale.index_select(0, block_ids).to(cache.out_dtype)
    return blocks.view(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)
