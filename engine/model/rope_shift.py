"""Re-rotating cached keys: the pool edit behind a rebase of an evicting sequence (cache/eviction).

RoPE rotates each pair of a key's channels by ``position * inv_freq``; rotating a key cached at
position ``p`` back by ``delta`` gives the key at ``p - delta`` (rotations compose), so a rebase
moves kept keys to their new positions without recomputing them. Done once per rebase, in
torch on the pool's tensors, for every layer: fp32 and fp16 pools in place (fp16 rounds once
more), int8 pools dequantized, rotated and quantized again (per token and head, as written).
Values carry no position and are never touched.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.eviction import RopeShift
from engine.kv.int8 import Int8KV, dequantize, quantize


def rotation(cos: torch.Tensor, sin: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure rotation by ``delta`` positions as (cos, sin) rows ``[head_dim]`` in float32: the
    tables' row ``delta`` without a scaled RoPE's attention factor (its magnitude)."""
    if not 0 <= delta < cos.shape[0]:
        raise ValueError(f"a RoPE delta of {delta} is outside the tables' {cos.shape[0]} positions")
    c, s = cos[delta].float(), sin[delta].float()
    norm = torch.sqrt(c * c + s * s)
    return c / norm, s / norm


def rotate_back(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys [..., head_dim]`` (float32) rotated by minus the rotation (cos, sin) (rotate-half
    convention, as engine/model/rope.py): ``k cos - rotate_half(k) sin``."""
    half = keys.shape[-1] // 2
    rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return keys * cos - rotated * sin


def _shift_keys(k_cache: torch.Tensor | Int8KV, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if isinstance(k_cache, Int8KV):
        keys = dequantize(k_cache.data.index_select(0, ids), k_cache.scale.index_select(0, ids), torch.float32)
        codes, scale = quantize(rotate_back(keys, cos, sin))
        k_cache.data.index_copy_(0, ids, codes)
        k_cache.scale.index_copy_(0, ids, scale)
        return
    keys = k_cache.index_select(0, ids).float()
    k_cache.index_copy_(0, ids, rotate_back(keys, cos, sin).to(k_cache.dtype))


def _copy_block(cache: torch.Tensor | Int8KV, src: torch.Tensor, dst: torch.Tensor) -> None:
    for tensor in (cache.tensors() if isinstance(cache, Int8KV) else [cache]):
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


def apply_rope_shifts(kv_caches: Sequence[tuple[torch.Tensor | Int8KV, torch.Tensor | Int8KV]],
                      shifts: Sequence[RopeShift], rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> None:
    """Apply each shift in order to every layer's pools: its copies, then its keys' rotation."""
    for shift in shifts:
        device = rope_cos.device
        if shift.copies:
            src = torch.tensor([s for s, _ in shift.copies], dtype=torch.long, device=device)
            dst = torch.tensor([d for _, d in shift.copies], dtype=torch.long, device=device)
            for k_cache, v_cache in kv_caches:
                _copy_block(k_cache, src, dst)
                _copy_block(v_cache, src, dst)
        if not shift.block_ids or shift.delta == 0:
            continue
        cos, sin = rotation(rope_cos, rope_sin, shift.delta)
        ids = torch.tensor(shift.block_ids, dtype=torch.long, device=device)
        for k_cache, _ in kv_caches:
            _shift_keys(k_cache, ids, cos, sin)
