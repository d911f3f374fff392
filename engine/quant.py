"""Linear layers computed straight from a GGUF checkpoint's quantized blocks.

A GGUF file stores most matrices as blocks of 32 or 256 weights: Q4_1 (fp16 scale and offset,
4-bit codes; 0.625 bytes a weight), Q8_0 (fp16 scale, 8-bit codes; 1.06 bytes a weight), the K
formats of Q4_K_M / Q5_K_M files (0.56-0.82 bytes a weight), Q4_0, Q5_0, Q5_1; F16 / BF16
files store plain halves (2 bytes a weight), which the kernel reads the same way. The
loader converts the file once to a dense fp32 checkpoint holding exactly the values those
blocks decode to, and that dense copy is what prefill runs on. Decode, though, streams every
weight once per step for a handful of rows, so its speed is weight bytes over memory
bandwidth, and fp32 is 6.4x (Q4_1) or 3.8x (Q8_0) more bytes than the blocks it came from.
kvserve keeps the blocks of each linear layer next to the dense weights and sends calls of
up to ``BlockLinear.MAX_ROWS`` rows to the native kernel (``engine/kernels/quant_linear.cpp``),
which expands each weight in registers and multiplies in fp32.

Contract: a block matrix is attached to a layer only when it decodes to that layer's dense
parameter bit for bit (checked at load), so both paths compute the same function of the
same weights and differ only in summation order, like any two fp32 matmul kernels.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import torch

from engine.arch import ModelArch
from engine.gguf_index import GGUFTensorInfo, read_gguf_index


class BlockFormat(IntEnum):
    """GGUF block formats the kernel reads; the values are the kernel's format codes.

    Q4_1 and Q8_0 are regrouped at load into strips of 8 output columns (``PackedMatrix``);
    the others run on GGUF's rows of blocks exactly as the file stores them. F16 and BF16 (the
    matrices of F16 / BF16 files) are not quantized: the kernel reads their rows 32 halves (64
    bytes) at a time, as blocks of 32 without a scale, and widens them to fp32 exactly."""

    Q4_1 = 0
    Q8_0 = 1
    Q4_0 = 2
    Q4_K = 3
    Q5_K = 4
    Q6_K = 5
    Q5_0 = 6
    Q5_1 = 7
    F16 = 8
    BF16 = 9

    @property
    def block_bytes(self) -> int:
        return _LAYOUT[self][1]

    @property
    def block_weights(self) -> int:
        return _LAYOUT[self][0]

    @property
    def strips(self) -> bool:
        """Whether the kernel reads this format regrouped into strips (see gguf_pack)."""
        return self in (BlockFormat.Q4_1, BlockFormat.Q8_0)

    @property
    def ggml_type(self) -> "gguf.GGMLQuantizationType":  # noqa: F821
        import gguf

        return gguf.GGMLQuantizationType[self.name]

    @classmethod
    def from_ggml(cls, ggml_type: int) -> "BlockFormat | None":
        import gguf

        name = gguf.GGMLQuantizationType(ggml_type).name
        return cls[name] if name in cls.__members__ else None


# weights per block, bytes per block (GGUF's own block sizes)
_LAYOUT = {BlockFormat.Q4_1: (32, 20), BlockFormat.Q8_0: (32, 34), BlockFormat.Q4_0: (32, 18),
           BlockFormat.Q4_K: (256, 144), BlockFormat.Q5_K: (256, 176), BlockFormat.Q6_K: (256, 210),
           BlockFormat.Q5_0: (32, 22), BlockFormat.Q5_1: (32, 24), BlockFormat.F16: (32, 64),
           BlockFormat.BF16: (32, 64)}


@dataclass
class GGUFMatrix:
    """A ``[out_features, in_features]`` matrix as a GGUF file stores it: ``data`` is uint8
    ``[out_features, in_features / block_weights * block_bytes]``, one row of blocks per output feature."""

    data: torch.Tensor
    format: BlockFormat
    in_features: int

    def __post_init__(self) -> None:
        per = self.format.block_weights
        want = self.in_features // per * self.format.block_bytes
        if (self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.in_features % per
                or self.data.shape[1] != want):
            raise ValueError(f"not {self.format.name} rows of {self.in_features} weights: "
                             f"{tuple(self.data.shape)} {self.data.dtype}")
        self.data = self.data.contiguous()

    @staticmethod
    def stack(parts: list[GGUFMatrix | None]) -> GGUFMatrix | None:
        """The parts' rows one after another (as ``torch.cat`` of the dense matrices), or None
        when a part is missing or the parts differ in format or width."""
        present = [p for p in parts if p is not None]
        if not present or len(present) < len(parts):
            return None
        first = present[0]
        if any(p.format != first.format or p.in_features != first.in_features for p in present):
            return None
        data = first.data if len(present) == 1 else torch.cat([p.data for p in present])
        return GGUFMatrix(data, first.format, first.in_features)

    def pack(self) -> PackedMatrix:
        """The kernel's layout: strips of 8 output columns for Q4_1/Q8_0 (same bytes, see
        quant_linear.cpp); the GGUF rows themselves (no copy) for the other formats."""
        data = (torch.ops.kvserve.gguf_pack(self.data, self.in_features, int(self.format))
                if self.format.strips else self.data)
        return PackedMatrix(data, self.format, self.data.shape[0], self.in_features)


@dataclass
class PackedMatrix:
    """GGUF blocks in the kernel's layout (see ``GGUFMatrix.pack``)."""

    data: torch.Tensor
    format: BlockFormat
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix the kernel multiplies by: value for value what gguf's own
        dequantization of the original blocks gives."""
        return torch.ops.kvserve.gguf_unpack(self.data, self.out_features, self.in_features, int(self.format))


@dataclass
class BlockMatrix:
    """A (possibly fused) matrix as row groups of packed blocks, one format per group: a
    Q4_K_M file stores q and k as Q4_K but v as Q6_K in some layers, so their fused qkv is
    two groups, each run by the kernel of its format."""

    parts: list[PackedMatrix]

    @staticmethod
    def stack(parts: list[GGUFMatrix | None]) -> BlockMatrix | None:
        """The parts' rows one after another, consecutive parts of one format stacked into one
        group; None when a part is missing or the widths differ."""
        if not parts or any(p is None for p in parts) or len({p.in_features for p in parts}) > 1:
            return None
        groups: list[list[GGUFMatrix]] = []
        for p in parts:
            if groups and groups[-1][0].format == p.format:
                groups[-1].append(p)
            else:
                groups.append([p])
        return BlockMatrix([GGUFMatrix.stack(g).pack() for g in groups])

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def format(self) -> BlockFormat | None:
        """The format when all groups share one (a single group), else None."""
        return self.parts[0].format if len(self.parts) == 1 else None

    @property
    def formats(self) -> set[BlockFormat]:
        return {p.format for p in self.parts}

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


class BlockLinear:
    """``F.linear(x, W, bias)`` with W held as GGUF blocks (a ``PackedMatrix``).

    Calls of at most ``max_rows`` rows (decode) run the block kernel, which streams the blocks
    once. Larger calls (prefill, big batches) run ``dense`` (the same op on a dense fp32 copy
    of W, through oneDNN or MKL) when there is one; without one (``weights_resident:
    blocks``) they run ``gguf_linear_panels``: the blocks decoded tile by tile into a
    cache-sized fp32 panel, one MKL GEMM per tile, so no dense copy is ever resident.

    ``MAX_ROWS``, measured per format on this project's 2-core CPU against oneDNN on packed
    fp32 weights (``bench/quant_linear.py``): the kernel reads 3.8-7x fewer bytes, which wins
    while a call is bandwidth bound; with more rows the matmul turns compute bound, and
    expanding each weight to fp32 costs more than oneDNN's blocking saves. F16 / BF16 read 2x
    fewer bytes and widen for free: SmolLM2 F16 at 16 streams, a step 45-46 ms on the kernel
    against 59 on a dense fp32 copy and ~70 on the panels (``bench.step_profile``).
    """

    MAX_ROWS = {BlockFormat.Q4_1: 16, BlockFormat.Q8_0: 4, BlockFormat.Q4_0: 16, BlockFormat.Q4_K: 16,
                BlockFormat.Q5_K: 16, BlockFormat.Q6_K: 8, BlockFormat.Q5_0: 16, BlockFormat.Q5_1: 16,
                BlockFormat.F16: 16, BlockFormat.BF16: 16}
    # int8 activations: integer dot products keep the block kernel ahead of dense fp32 GEMM up to
    # 16 rows for every format that has one (bench.activation_quant speed, 16 streams). Beyond
    # that (prefill) the int8 kernel stays on, as llama.cpp's does, where it measured faster at
    # every row count (17-1,024): on AVX512-VNNI CPUs for Q4_1 and Q8_0 (strip pairs in 512-bit
    # registers: 1.6-2.3x oneDNN fp32 on Zen 5, SmolLM2's seven layer matmuls), and when there is
    # no dense copy for the formats whose int8 kernel beats the fp32 panels (8192 x 2048 Q4_K at 64
    # / 256 rows 6.9 / 28 ms vs 14.5 / 51 ms, Q6_K 8.5 / 35 vs 15.6 / 51). Q4_0 / Q5_0 / Q5_1's
    # row kernel only matches the panels at 128 rows (4096 x 2048, one thread: 21-28 vs 22 ms).
    # Without a dense copy the alternative is the panels, which every format's kernel beats up to
    # 24 rows (bench.quant_linear on SmolLM2 Q4_K_M: Q5_0 / Q6_K / Q8_0 at 16 rows 1.2-1.7x;
    # the 1B Q4_K_M's 16-stream step 360 -> 317 ms with Q6_K's bound 8 -> 16)
    BLOCKS_ONLY_MAX_ROWS = 16
    INT8_MAX_ROWS = 16
    INT8_VNNI_FORMATS = frozenset({BlockFormat.Q4_1, BlockFormat.Q8_0})
    INT8_OVER_PANELS_FORMATS = frozenset({BlockFormat.Q4_1, BlockFormat.Q8_0, BlockFormat.Q4_K, BlockFormat.Q5_K,
                                          BlockFormat.Q6_K})
    PANEL_BYTES = 4 << 20  # fp32 bytes of one decoded tile in block-only prefill

    def __init__(self, blocks: PackedMatrix | BlockMatrix, bias: torch.Tensor | None,
                 dense: Callable[[torch.Tensor], torch.Tensor] | None, int8_activations: bool = False) -> None:
        self.blocks = blocks if isinstance(blocks, BlockMatrix) else BlockMatrix([blocks])
        self.bias = bias
        self.dense = dense
        self.tile_rows = max(8, self.PANEL_BYTES // (4 * self.blocks.in_features) // 8 * 8)
        # (data, out_features, kernel format code) per group, converted once rather than per call
        # (block bytes, rows, format id) of each part: the arguments of the native ops
        self.parts = [(p.data, p.out_features, int(p.format)) for p in self.blocks.parts]
        # int8_activations (ModelConfig.activation_quant): calls of up to max_rows rows run the
        # int8-activation kernel for the parts that have one on this CPU, the fp32 kernel otherwise
        self.use_int8_activations(int8_activations)

    def use_int8_activations(self, on: bool) -> None:
        """Bind the kernel of each part: int8 activations where ``on`` and the part's format has
        an int8 kernel on this CPU, else fp32; and ``max_rows`` to match."""
        self.int8_activations = on
        int8 = [on and torch.ops.kvserve.gguf_q8_supported(f) for _, _, f in self.parts]
        self.kernels = [torch.ops.kvserve.gguf_linear_q8 if q else torch.ops.kvserve.gguf_linear for q in int8]
        vnni = on and torch.ops.kvserve.gguf_q8_isa() == "vnni"

        def rows(q: bool, fmt: BlockFormat) -> int:
            if not q:
                return self.MAX_ROWS[fmt] if self.dense is not None else max(self.MAX_ROWS[fmt],
                                                                             self.BLOCKS_ONLY_MAX_ROWS)
            unbounded = ((self.dense is None and fmt in self.INT8_OVER_PANELS_FORMATS)
                         or (vnni and fmt in self.INT8_VNNI_FORMATS))
            return sys.maxsize if unbounded else self.INT8_MAX_ROWS
        self.max_rows = min(rows(q, p.format) for q, p in zip(int8, self.blocks.parts))
        # swiglu's fused kernel: one part, no bias, an int8 kernel, gate and up halves of whole strips
        half = self.blocks.out_features // 2
        fusable = len(self.parts) == 1 and self.bias is None and int8[0] and half % 8 == 0
        self.swiglu_args = (self.parts[0][0], half, self.parts[0][2]) if fusable else None

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``SiLU(gate) * up`` for a gate/up matrix (the gate's rows first) where this call would
        run one int8 kernel over the whole matrix: ``gguf_swiglu_q8`` computes the same products
        without the ``[rows, 2 * intermediate]`` tensor (32 MiB per 512-row prefill chunk of a
        1B model). None where it does not apply; the caller then splits ``self(x)``."""
        if self.swiglu_args is None or x.shape[0] > self.max_rows:
            return None
        return torch.ops.kvserve.gguf_swiglu_q8(x, *self.swiglu_args)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            if self.dense is not None:
                return self.dense(x)
            ys = [torch.ops.kvserve.gguf_linear_panels(x, d, n, f, self.tile_rows) for d, n, f in self.parts]
        else:
            ys = [op(x, d, n, f) for op, (d, n, f) in zip(self.kernels, self.parts)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        return y if self.bias is None else y.add_(self.bias)


# llama.cpp's tensor names for a Llama-family layer -> transformers' names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for tensors
    that are not linear weights (norms, ...)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for rotary embeddings (the inverse
    transformers applies when it reads a llama GGUF): new row i is old row ``index[i]``."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def gguf_row_order(gguf_arch: str, tensor_name: str, rows: int, arch: ModelArch) -> np.ndarray | None:
    """The row order that gives transformers' q/k matrix (and bias) from a llama GGUF's, else None."""
    if gguf_arch != "llama" or not (".attn_q." in tensor_name or ".attn_k." in tensor_name):
        return None
    return unpermute_rows(rows, arch.num_heads if ".attn_q." in tensor_name else arch.num_kv_heads)


def read_block_matrix(tensor: GGUFTensorInfo, raw: BinaryIO, gguf_arch: str, arch: ModelArch) -> GGUFMatrix | None:
    """``tensor`` (of the GGUF open as ``raw``) as blocks when it is a linear weight stored in a
    ``BlockFormat``, q/k rows in transformers' order; None otherwise, having read nothing."""
    fmt = BlockFormat.from_ggml(tensor.ggml_type) if hf_name(tensor.name) is not None else None
    if fmt is None or tensor.shape[0] % fmt.block_weights:  # F16 / BF16 rows the kernel cannot cut in 32s
        return None
    data = tensor.read(raw)  # [rows, row bytes]
    order = gguf_row_order(gguf_arch, tensor.name, tensor.shape[-1], arch)
    return GGUFMatrix(torch.from_numpy(data if order is None else data[order]), fmt, tensor.shape[0])


def read_gguf_blocks(path: Path, arch: ModelArch) -> dict[str, GGUFMatrix]:
    """The linear weights of a GGUF file stored in a ``BlockFormat`` (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) under transformers' names; matrices in other formats (F32,
    Q2_K, Q3_K, IQ*, ...) are left out and run dense."""
    index = read_gguf_index(path)
    with open(path, "rb") as raw:
        found = ((hf_name(t.name), read_block_matrix(t, raw, index.architecture, arch)) for t in index.tensors)
        return {name: matrix for name, matrix in found if matrix is not None}
