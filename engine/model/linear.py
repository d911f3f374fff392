"""The model's dense matmul kernels, and the policies that bind them: which linear backend runs
(``choose_linear``), whether block matmuls take int8 activations (``resolve_activation_quant``,
``check_activation_quant``, ``describe_activation_quant``) and whether prefill chunks multiply the
block matrices in bf16 (``resolve_prefill_matmul_dtype``, ``describe_prefill_matmuls``).

Backends (``ModelConfig.linear_backend``): ``aten`` (``F.linear``, MKL), ``onednn``
(``PackedLinear``), ``gguf`` (``engine.model.block_linear.BlockLinear`` on the GGUF blocks, the
rest as ``onednn``), ``auto``. Every backend computes ``F.linear`` of the same weights; they
differ only in fp32 summation order.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from engine.config import ACTIVATION_QUANTS
from engine.kernels import load_kernels
from engine.loader.gguf.blocks import BlockFormat
from engine.model.block_linear import BlockLinear
from engine.prefill_dtype import resolve_prefill_dtype

LINEAR_BACKENDS = ("auto", "gguf", "onednn", "aten")


def onednn_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedLinear:
    """``F.linear`` that sends calls of ``min_rows`` rows or more through oneDNN, with the
    weight reordered once into oneDNN's blocked layout; smaller calls stay on ``F.linear``.

    Measured on this project's 2-core CPU (30 layers of SmolLM2-135M, fp32): from 4 rows up
    the packed kernels run the matmuls 15-35% faster than ``F.linear`` (MKL repacks the
    weight on every call), and they degrade far less when another process shares the
    cores; at 1-3 rows MKL's gemv streams the weights faster, so a single stream keeps it
    (and stays bit-identical to transformers). Packed results differ from ``F.linear`` only
    in summation order (relative differences around 1e-7). The packed copy doubles the
    memory of the weights it covers.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 16,
                 min_rows: int = 4) -> None:
        self.dense = weight
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.min_rows = min_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.min_rows:
            return F.linear(x, self.dense, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                 batch_hint: int = 16) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.linear`` on ``weight`` for ``aten``, through oneDNN's packed layout for ``onednn``."""
    if backend == "onednn":
        return PackedLinear(weight, bias, batch_hint)
    return lambda x: F.linear(x, weight, bias)


@dataclass(frozen=True)
class LinearChoice:
    """What ``choose_linear`` decided: the backend reported (``gguf``, ``onednn`` or ``aten``),
    the dense kernel under it (``dense_linear``'s ``onednn`` or ``aten``) and whether matrices
    with GGUF blocks run from them."""

    backend: str
    dense: str
    use_blocks: bool


def choose_linear(backend: str, has_blocks: bool, blocks_only: bool, device: torch.device, dtype: torch.dtype,
                  activation_quant: str = "none") -> LinearChoice:
    """The linear backend a model runs, or ValueError with the reason it cannot.

    ``aten``: ``F.linear`` (MKL). ``onednn``: calls of 4+ rows through oneDNN on a second,
    packed copy of each weight (see PackedLinear); ``aten`` where oneDNN cannot run (not
    fp32 on a CPU). ``gguf``: the matrices that have GGUF blocks (``has_blocks``, see
    ``LlamaForCausalLM.attach_blocks``) run calls of up to ``BlockLinear.MAX_ROWS`` rows from
    the blocks, everything else as ``onednn``; an error when no blocks are attached. ``auto``:
    ``gguf`` when blocks are attached, else ``onednn``. ``blocks_only``: the model holds no
    dense copy of some matrices (``weights_resident: blocks``), so only ``auto`` and ``gguf``
    can run. ``activation_quant`` ``int8`` needs the ``gguf`` backend.
    """
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be auto, gguf, onednn or aten, got {backend!r}")
    if blocks_only and backend not in ("auto", "gguf"):
        raise ValueError(f"linear backend {backend!r} needs dense weights, and this model keeps only "
                         "GGUF blocks (weights_resident: blocks)")
    if backend == "gguf" and not has_blocks:
        raise ValueError("linear backend 'gguf' needs a GGUF checkpoint with block-format weights, a CPU "
                         "in float32 and the native kernels; use 'auto'")
    if backend == "auto":
        backend = "gguf" if has_blocks else "onednn"
    onednn_ok = device.type == "cpu" and dtype == torch.float32 and onednn_linear_available()
    dense = "onednn" if backend in ("gguf", "onednn") and onednn_ok else "aten"
    if backend == "onednn":
        backend = dense
    use_blocks = backend == "gguf"
    if activation_quant == "auto":
        raise ValueError("activation_quant 'auto' is resolved before the backend is chosen (resolve_activation_quant)")
    if activation_quant == "int8" and not use_blocks:
        raise ValueError("activation_quant 'int8' needs the gguf linear backend (a GGUF model's blocks on the "
                         f"CPU in float32), and the backend is {backend!r}; use activation_quant 'none'")
    return LinearChoice(backend, dense, use_blocks)


def resolve_activation_quant(mode: str, use_blocks: bool, block_formats: Iterable[int]) -> str:
    """``none`` or ``int8`` for ``mode`` (``ModelConfig.activation_quant``): ``auto`` (the
    default, llama.cpp's numerics) is ``int8`` where matrices run from GGUF blocks
    (``use_blocks``, the gguf backend) and this CPU has an int8-activation kernel for one of
    their formats (``block_formats``; ``gguf_q8_supported``: AVX2 or better), else ``none``."""
    if mode != "auto":
        return mode
    if not use_blocks:
        return "none"
    return "int8" if any(torch.ops.kvserve.gguf_q8_supported(int(f)) for f in set(block_formats)) else "none"


def bf16_matmul_runs() -> bool:
    """Whether the native kernels are loaded and this CPU runs their AMX-BF16 prefill matmul."""
    return load_kernels() and torch.ops.kvserve.gguf_linear_bf16_supported()


def resolve_prefill_matmul_dtype(mode: str, device: torch.device, dtype: torch.dtype, activation_quant: str,
                                 tensor_parallel_size: int = 1) -> str:
    """``float32`` or ``bfloat16`` for ``mode`` (``ModelConfig.prefill_matmul_dtype``), by
    ``engine.prefill_dtype``'s rule, shared with the prefill attention: the kernel that must run is
    ``gguf_linear_bf16`` (AMX-BF16), and an explicit ``bfloat16`` without it is a ValueError, as the
    matmuls have no other bf16 kernel."""
    return resolve_prefill_dtype("prefill_matmul_dtype", mode, device, dtype, activation_quant, tensor_parallel_size,
                                 tiles=bf16_matmul_runs,
                                 without_tiles="needs the native kernels on a CPU with AMX-BF16 and AVX512-BF16 "
                                               "(Sapphire Rapids or later)")


def describe_prefill_matmuls(mode: str, block_linears: Sequence[BlockLinear]) -> str:
    """The prefill matmul dtype as bound on ``block_linears``: which block matrices take bf16 tiles, from
    how many rows."""
    if mode != "bfloat16":
        return "float32 (prefill chunks run the decode kernels)"
    on = [mm for mm in block_linears if mm.bf16_prefill]
    by_rows: dict[int, set[str]] = {}
    for mm in on:
        by_rows.setdefault(mm.bf16_min_rows, set()).update(BlockFormat(f).name for _, _, f in mm.parts)
    where = "; ".join(f"{', '.join(sorted(names))} from {rows} rows" for rows, names in sorted(by_rows.items()))
    return (f"bfloat16 on AMX tiles for {len(on)} of {len(block_linears)} block matrices "
            f"({where or 'none: no format it takes'})")


def check_activation_quant(mode: str, linear_backend: str) -> None:
    """ValueError unless ``mode`` (a resolved ``ModelConfig.activation_quant``) can run on ``linear_backend``."""
    if mode not in ACTIVATION_QUANTS or mode == "auto":
        raise ValueError(f"activation_quant must be none or int8, got {mode!r}")
    if mode == "int8" and linear_backend != "gguf":
        raise ValueError("activation_quant 'int8' needs the gguf linear backend")


def describe_activation_quant(mode: str, block_linears: Sequence[BlockLinear]) -> str:
    """``activation_quant`` as bound on ``block_linears`` (the model's matmuls on GGUF blocks):
    which block matrices multiply int8 activations, and what prefill does."""
    if mode != "int8":
        return "none (fp32 activations)"
    parts = [(f, op is torch.ops.kvserve.gguf_linear_q8)
             for mm in block_linears for op, (_, _, f) in zip(mm.kernels, mm.parts)]
    int8 = sorted({BlockFormat(f).name for f, q in parts if q})
    fp32 = sorted({BlockFormat(f).name for f, q in parts if not q})
    # calls over INT8_MAX_ROWS rows (prefill) stay on the int8 kernel where max_rows is unbounded
    unbounded = [mm.max_rows == sys.maxsize for mm in block_linears]
    prefill = ("int8 as well" if unbounded and all(unbounded) else
               f"int8 for {sum(unbounded)} of {len(unbounded)} matmuls, fp32 for the rest" if any(unbounded)
               else "fp32 activations")
    return (f"int8 for {sum(q for _, q in parts)} of {len(parts)} block matrices "
            f"({', '.join(int8) or 'no format with an int8 kernel on this CPU'}); "
            f"fp32 activations for {', '.join(fp32) or 'none'} and dense matmuls; prefill: {prefill}")
