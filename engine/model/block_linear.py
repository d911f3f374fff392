"""Linear layers computed straight from a GGUF checkpoint's quantized blocks.

Decode streams every weight once per step for a handful of rows, so its speed is weight bytes
over memory bandwidth, and fp32 is 6.4x (Q4_1) or 3.8x (Q8_0) more bytes than the blocks it
came from. kvserve keeps the blocks of each linear layer (``engine.loader.gguf.blocks``) and
sends calls of up to ``BlockLinear.MAX_ROWS`` rows to the native kernel
(``engine/kernels/cpu/quant_linear.cpp``), which expands each weight in registers and
multiplies in fp32 (or, with int8 activations, in integers).

Contract: a block matrix is attached to a layer only when it decodes to that layer's dense
parameter bit for bit (checked at load), so both paths compute the same function of the
same weights and differ only in summation order, like any two fp32 matmul kernels.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterable

import torch

from engine.loader.gguf.blocks import BlockFormat, BlockMatrix, PackedMatrix


class BlockLinear:
    """``F.linear(x, W, bias)`` with W held as GGUF blocks (a ``PackedMatrix``).

    Calls of at most ``max_rows`` rows (decode) run the block kernel, which streams the blocks
    once. Larger calls (prefill, big batches) run ``dense`` (the same op on a dense fp32 copy
    of W, through oneDNN or MKL) when there is one; without one (``weights_resident:
    blocks``) they run ``gguf_linear_panels``: the blocks decoded tile by tile into a
    cache-sized fp32 panel, one MKL GEMM per tile, so no dense copy is ever resident. With
    ``use_bf16_prefill`` (``prefill_matmul_dtype`` bfloat16), calls of ``bf16_min_rows`` rows or
    more run ``gguf_linear_bf16`` instead, on AMX-BF16 tiles, whatever the other bounds say.

    ``MAX_ROWS``, measured per format on this project's 2-core CPU against oneDNN on packed
    fp32 weights (``bench/probes/quant_linear.py``): the kernel reads 3.8-7x fewer bytes, which wins
    while a call is bandwidth bound; with more rows the matmul turns compute bound, and
    expanding each weight to fp32 costs more than oneDNN's blocking saves. F16 / BF16 read 2x
    fewer bytes and widen for free: SmolLM2 F16 at 16 streams, a step 45-46 ms on the kernel
    against 59 on a dense fp32 copy and ~70 on the panels (``bench.probes.step_profile``).
    """

    MAX_ROWS = {BlockFormat.Q4_1: 16, BlockFormat.Q8_0: 4, BlockFormat.Q4_0: 16, BlockFormat.Q4_K: 16,
                BlockFormat.Q5_K: 16, BlockFormat.Q6_K: 8, BlockFormat.Q5_0: 16, BlockFormat.Q5_1: 16,
                BlockFormat.F16: 16, BlockFormat.BF16: 16}
    # int8 activations: integer dot products keep the block kernel ahead of dense fp32 GEMM up to
    # 16 rows for every format that has one (bench.probes.activation_quant speed, 16 streams). Beyond
    # that (prefill) the int8 kernel stays on, as llama.cpp's does, for INT8_PREFILL_FORMATS on every
    # CPU with an int8 kernel, so a row's numerics never depend on how many rows share its call:
    # - AVX512-VNNI (strip pairs in 512-bit registers, the K-quants' 512-bit lanes, on AMX CPUs tiles):
    #   1.6-2.3x oneDNN fp32 on Zen 5 for SmolLM2's seven layer matmuls; 2.4-2.8x at 64 and 512 rows
    #   for the 1B Q4_K_M's on a Zen 4, 2 threads, bench.probes.quant_linear --int8.
    # - AVX2 only (a Zen 3, 2 threads, the same probe): Q4_1 1.3-2.5x oneDNN fp32 at 17-512 rows,
    #   Q5_0 1.5-3.4x, Q8_0 (the LM head) 1.0-1.5x; the 1B's Q4_K 1.7-2.2x and Q6_K 1.5-2.0x at 64
    #   and 512 rows (the K-quants' ymm lanes; before them 1.1-1.6x and 0.92-1.03x).
    # Without a dense copy the alternative is the panels, which every format's kernel beats up to
    # 24 rows (bench.probes.quant_linear on SmolLM2 Q4_K_M: Q5_0 / Q6_K / Q8_0 at 16 rows 1.2-1.7x;
    # the 1B Q4_K_M's 16-stream step 360 -> 317 ms with Q6_K's bound 8 -> 16), and which
    # INT8_OVER_PANELS_FORMATS beat at every row count (8192 x 2048 Q4_K at 64 / 256 rows 6.9 / 28 ms
    # vs 14.5 / 51 ms, Q6_K 8.5 / 35 vs 15.6 / 51; Q5_K besides INT8_PREFILL_FORMATS). Q4_0 / Q5_1's
    # row kernel only matches the panels at 128 rows (4096 x 2048, one thread: 21-28 vs 22 ms).
    BLOCKS_ONLY_MAX_ROWS = 16
    INT8_MAX_ROWS = 16
    INT8_PREFILL_FORMATS = frozenset({BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0, BlockFormat.Q4_K,
                                      BlockFormat.Q6_K})
    INT8_OVER_PANELS_FORMATS = frozenset({BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0, BlockFormat.Q4_K,
                                          BlockFormat.Q5_K, BlockFormat.Q6_K})
    PANEL_BYTES = 4 << 20  # fp32 bytes of one decoded tile in block-only prefill
    # prefill_matmul_dtype bfloat16 (engine.model.linear.resolve_prefill_matmul_dtype): calls of at
    # least BF16_MIN_ROWS[format] rows (the largest of the matrix's parts; a format not listed never)
    # run gguf_linear_bf16: x and the decoded weights rounded to bf16, AMX-BF16 tiles, fp32 sums, no
    # dense copy. The K-quants' int8 tile kernel applies a scale per 32 weights after each product,
    # which bounds it at 512 rows: the bf16 tiles measured 1.1-2.3x faster there on the 1B Q4_K_M's
    # four matrices. Since Q4_K and Q6_K super-blocks decode straight to bf16 (prefill_linear.cpp),
    # the bf16 tiles also win at 32-96 rows (1.1-1.4x at 32, 1.4-1.7x at 50, 1.5-2.0x at 96 on
    # those matrices; before, 0.9-1.2x at 64), so Q4_K / Q6_K start at 32; Q5_K, decoded through
    # fp32, stays at 128. The strip formats' int8 AMX strip pairs were faster below a few hundred
    # rows (Q4_1 at 128 rows 0.6-0.86x) and even to 1.3x slower at 512 (SmolLM2's matrices
    # 0.93-1.32x); with Q4_1's strips decoded straight to bf16 too, SmolLM2's Q4_1 matrices run
    # 1.05-1.23x faster on the tiles at 64 rows, 1.2-1.28x at 128, 1.24-1.52x at 200, and its 200- and
    # 300-row prefill steps in process 0.80-0.84x the time at 128 against 384, so Q4_1 starts at 128
    # (the native path's chunk steps, to 127 tiled rows, unchanged). Q5_0 and Q8_0, decoded through
    # fp32, stayed at 384; straight to bf16 since, SmolLM2 Q4_K_M's Q5_0 matrices run 1.04-1.14x
    # faster on the tiles at 64 rows, 0.95-1.19x at 128, 1.1-1.47x at 256, its Q8_0 LM head 0.97x /
    # 1.25x / 1.53x, and the Q8_0 and Q4_K_M files' 200- and 300-row prefill steps in process
    # 0.75-0.9x the time at 128 against 384, so both start at 128. 2 threads,
    # bench.probes.quant_linear --int8's bf16 column.
    # F16 / BF16 / Q4_0 / Q5_1 keep the fp32 activations llama.cpp gives them.
    BF16_MIN_ROWS = {BlockFormat.Q4_K: 32, BlockFormat.Q5_K: 128, BlockFormat.Q6_K: 32,
                     BlockFormat.Q4_1: 128, BlockFormat.Q5_0: 128, BlockFormat.Q8_0: 128}

    @classmethod
    def dense_copy_unread(cls, formats: Iterable[BlockFormat | None]) -> bool:
        """Whether, with int8 activations on this CPU, matrices of ``formats`` run every call on
        their blocks with or without a dense copy (every format in ``INT8_PREFILL_FORMATS`` with an
        int8 kernel here, the rule ``use_int8_activations`` binds; None, a format without a kernel,
        is not): a dense fp32 copy would then never be read."""
        return all(f in cls.INT8_PREFILL_FORMATS and torch.ops.kvserve.gguf_q8_supported(int(f)) for f in formats)

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
        self.use_bf16_prefill(False)

    def use_bf16_prefill(self, on: bool) -> None:
        """Calls of ``bf16_min_rows`` rows or more on the AMX-BF16 kernel, where ``on`` and every
        part's format is in ``BF16_MIN_ROWS`` (``prefill_matmul_dtype`` bfloat16); else never."""
        formats = [p.format for p in self.blocks.parts]
        listed = on and all(f in self.BF16_MIN_ROWS for f in formats)
        self.bf16_min_rows = max(self.BF16_MIN_ROWS[f] for f in formats) if listed else sys.maxsize
        half = self.blocks.out_features // 2
        single = len(self.parts) == 1 and self.bias is None and half % 8 == 0
        self.bf16_swiglu_args = (self.parts[0][0], half, self.parts[0][2]) if listed and single else None

    @property
    def bf16_prefill(self) -> bool:
        """Whether some calls take the AMX-BF16 kernel (``use_bf16_prefill``)."""
        return self.bf16_min_rows != sys.maxsize

    def use_int8_activations(self, on: bool) -> None:
        """Bind the kernel of each part: int8 activations where ``on`` and the part's format has
        an int8 kernel on this CPU, else fp32; and ``max_rows`` to match."""
        self.int8_activations = on
        int8 = [on and torch.ops.kvserve.gguf_q8_supported(f) for _, _, f in self.parts]
        self.kernels = [torch.ops.kvserve.gguf_linear_q8 if q else torch.ops.kvserve.gguf_linear for q in int8]

        def rows(q: bool, fmt: BlockFormat) -> int:
            if not q:
                return self.MAX_ROWS[fmt] if self.dense is not None else max(self.MAX_ROWS[fmt],
                                                                             self.BLOCKS_ONLY_MAX_ROWS)
            unbounded = (fmt in self.INT8_PREFILL_FORMATS
                         or (self.dense is None and fmt in self.INT8_OVER_PANELS_FORMATS))
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
        1B model); on the bf16 tiles (``gguf_swiglu_bf16``) where ``__call__`` would take them. None
        where neither applies; the caller then splits ``self(x)``."""
        if self.bf16_swiglu_args is not None and x.shape[0] >= self.bf16_min_rows:
            return torch.ops.kvserve.gguf_swiglu_bf16(x, *self.bf16_swiglu_args)
        if self.swiglu_args is None or x.shape[0] > self.max_rows:
            return None
        return torch.ops.kvserve.gguf_swiglu_q8(x, *self.swiglu_args)

    def _bf16_parts(self, x: torch.Tensor) -> torch.Tensor:
        """Every part on the AMX-BF16 kernel, each into its columns of one output (no concatenation:
        ~1% of a 1,000-token prefill of the 1B-shaped Q4_K_M, whose q / k and v differ in format)."""
        if len(self.parts) == 1:
            data, n, fmt = self.parts[0]
            return torch.ops.kvserve.gguf_linear_bf16(x, data, n, fmt)
        y = x.new_empty(x.shape[0], self.blocks.out_features)
        col = 0
        for data, n, fmt in self.parts:
            torch.ops.kvserve.gguf_linear_bf16_out(x, data, n, fmt, y[:, col:col + n])
            col += n
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.bf16_min_rows:
            y = self._bf16_parts(x)
        else:
            if x.shape[0] > self.max_rows:
                if self.dense is not None:
                    return self.dense(x)
                ys = [torch.ops.kvserve.gguf_linear_panels(x, d, n, f, self.tile_rows) for d, n, f in self.parts]
            else:
                ys = [op(x, d, n, f) for op, (d, n, f) in zip(self.kernels, self.parts)]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        return y if self.bias is None else y.add_(self.bias)
