"""GGUF block formats and the matrices held in them, as the kernels read them.

A GGUF file stores most matrices as blocks of 32 or 256 weights: Q4_1 (fp16 scale and offset,
4-bit codes; 0.625 bytes a weight), Q8_0 (fp16 scale, 8-bit codes; 1.06 bytes a weight), the K
formats of Q4_K_M / Q5_K_M files (0.56-0.82 bytes a weight), Q4_0, Q5_0, Q5_1; F16 / BF16
files store plain halves (2 bytes a weight), which the kernel reads the same way.

``GGUFMatrix`` is one matrix's raw blocks as read from the file; ``PackedMatrix`` the same
rows in the kernels' layout; ``BlockMatrix`` a fused matrix (q/k/v, gate/up) of several
packed parts. ``engine.model.block_linear.BlockLinear`` multiplies by them.

Contract: ``dequantize`` of any of them equals gguf's own ``dequantize`` of the file's tensor
bit for bit (tests/engine/loader/test_gguf_formats.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class BlockFormat(IntEnum):
    """GGUF block formats the kernel reads; the values are the kernel's format codes.

    Q4_1, Q5_0 and Q8_0 are regrouped at load into strips of 8 output columns (``PackedMatrix``,
    the same bytes); the others run on GGUF's rows of blocks exactly as the file stores them. F16 and BF16 (the
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
        return self in (BlockFormat.Q4_1, BlockFormat.Q8_0, BlockFormat.Q5_0)

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
        """The kernel's layout: strips of 8 output columns for Q4_1, Q5_0 and Q8_0 (the same
        bytes regrouped, see quant_linear.cpp); the GGUF rows themselves (no copy) for the other
        formats."""
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
