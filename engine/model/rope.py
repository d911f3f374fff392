"""Rotary position embeddings (RoPE): the cos/sin tables and their application to q and k.

Contract: the tables are transformers' own (its RoPE initialisers compute the inverse
frequencies, scaled variants included), and ``apply_rope_signed`` computes HF Llama's
rotate-half RoPE bit for bit.
"""
from __future__ import annotations

from typing import Any

import torch


def rope_cos_sin(hf_config: Any, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` for every supported RoPE variant.

    The inverse frequencies come from transformers' own RoPE initialisers (default, llama3,
    linear, yarn, ...), so scaled variants match the reference implementation exactly.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    positions = torch.arange(max_positions, dtype=torch.float)
    inv_freq = inv_freq.to(positions.device)  # the initialisers build on the CPU; the model may be elsewhere
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, d]``, cos/sin ``[T, 1, d]`` (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`apply_rope_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in three ops instead of five, bit for bit the same result.

    rotate_half(x) * sin = [-x2, x1] * [s1, s2] = [x2, x1] * [-s1, s2] exactly (negation is
    exact in IEEE arithmetic), so the sign moves into a precomputed table and the rotation is
    a plain half swap; the products and the final sum are the same operations as HF's.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed)
    return (x * cos).add_(swapped)  # in place: two [T, heads, d] temporaries instead of four
