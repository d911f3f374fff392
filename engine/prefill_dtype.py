"""The dtype a float32 model's prefill chunks compute in on the CPU: the one rule behind
``ModelConfig.prefill_attention_dtype`` (``engine.attention.precision``) and
``ModelConfig.prefill_matmul_dtype`` (``engine.model.linear``).

Contract: ``auto`` is ``bfloat16`` only where the approximate numerics are in force already
(``activation_quant`` resolved to ``int8``: llama.cpp's), on one rank, for a float32 model on the
CPU, and where the field's bf16 kernel runs (AMX-BF16); everywhere else ``float32``, so the exact
flags compute exactly as before. ``bfloat16`` asked for explicitly is a ValueError that says why
where it has no meaning (a model not in float32, a GPU), is not implemented (tensor parallel
ranks) or, for a field with no other bf16 kernel to fall back to, cannot run on this CPU.
"""
from __future__ import annotations

from typing import Callable

import torch


def resolve_prefill_dtype(field: str, mode: str, device: torch.device, dtype: torch.dtype, activation_quant: str,
                          tensor_parallel_size: int, *, tiles: Callable[[], bool],
                          without_tiles: str | None) -> str:
    """``float32`` or ``bfloat16`` for ``mode`` of the config field ``field``.

    ``tiles()`` says whether the field's bf16 kernel runs on this CPU; it is asked only for a
    float32 model on one CPU rank. ``without_tiles`` completes the refusal of an explicit
    ``bfloat16`` where it does not run, or is None where the field falls back to another kernel."""
    fits = device.type == "cpu" and dtype == torch.float32
    if mode == "auto":
        approximate = activation_quant == "int8" and tensor_parallel_size == 1
        return "bfloat16" if approximate and fits and tiles() else "float32"
    if mode == "bfloat16":
        if not fits:
            raise ValueError(f"{field} 'bfloat16' applies to a float32 model on the CPU (a "
                             f"{str(dtype).removeprefix('torch.')} model on {device.type} computes in its own dtype)")
        if tensor_parallel_size > 1:
            raise ValueError(f"{field} 'bfloat16' is not implemented with tensor_parallel_size > 1")
        if without_tiles is not None and not tiles():
            raise ValueError(f"{field} 'bfloat16' {without_tiles}")
    return mode
