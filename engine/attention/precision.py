"""The dtype a prefill chunk attends in (``ModelConfig.prefill_attention_dtype``).

A float32 model on the CPU attends in float32 (on the ``native`` backend, its AVX2 kernel:
engine/kernels/cpu/prefill_attention_f32.cpp) unless this says ``bfloat16``: then a prefill chunk's
q, k and v are rounded to bf16 and multiplied on the AMX tiles of CPUs that have them, by the
``native`` backend's own kernel (engine/kernels/cpu/prefill_attention.cpp) or else torch's flash
kernel; the softmax and its sums stay fp32, and the output returns to fp32. Measured on a Sapphire
Rapids VM (torch's kernel, 2 threads, 9 heads of 64 over 3 KV heads): 512 queries over 512 / 1,000 /
4,000 keys 4.2 / 7.4 / 28.5 ms in fp32 against 1.5 / 3.8 / 12.0 in bf16; a 1,000 / 4,000-token
prompt's prefill 0.68-0.79x / 0.56-0.61x the time. Decode rows keep the fp32 paged kernel, whose cost is
reading the pool, not multiplying.

Contract: ``engine.prefill_dtype``'s, shared with the prefill matmuls: ``auto`` is ``bfloat16``
only where the approximate numerics are in force already (``activation_quant`` resolved to ``int8``:
llama.cpp's, whose own attention multiplies fp16 Q by fp16 K) and the CPU has AMX-BF16; everywhere
else ``float32``, so the exact flags (``--activation-quant none``) attend exactly as before.
``bfloat16`` asked for explicitly is refused where it has no meaning (a model not in float32, a
GPU) or is not implemented (tensor parallel ranks).
"""
from __future__ import annotations

import torch

from engine.platform.cpu_features import has_amx_bf16
from engine.prefill_dtype import resolve_prefill_dtype

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def resolve_prefill_attention_dtype(mode: str, device: torch.device, dtype: torch.dtype, activation_quant: str,
                                    tensor_parallel_size: int = 1) -> str:
    """``float32`` or ``bfloat16`` for ``mode`` (``auto`` resolved by ``engine.prefill_dtype``'s
    rule); ValueError where an explicit ``bfloat16`` cannot apply. Without AMX-BF16 an explicit
    ``bfloat16`` still runs, on torch's flash kernel."""
    return resolve_prefill_dtype("prefill_attention_dtype", mode, device, dtype, activation_quant,
                                 tensor_parallel_size, tiles=has_amx_bf16, without_tiles=None)
