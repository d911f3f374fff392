"""The bf16 prefill matmul (engine/kernels/cpu/prefill_linear.cpp) against float64 arithmetic on the
same bf16-rounded operands, every block format; its fused SiLU(gate) * up; row independence; errors.

The kernel's contract: x and the decoded weights rounded to bf16 (to nearest, ties to even), the
products summed in fp32 on the AMX tiles. So the reference is float64 over exactly those operands,
and the tolerance is fp32 summation error, relative to the sum of the terms' magnitudes: a wrong
tile layout, a lost K block or a misplaced row would be off by the size of the terms themselves."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.loader.gguf.blocks import BlockFormat
from tests.engine.loader.test_gguf_formats import FORMATS, blocks_and_reference, own_layout
from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()
    if not torch.ops.kvserve.gguf_linear_bf16_supported():
        pytest.skip("the bf16 prefill kernel needs AMX-BF16 and AVX512-BF16 (Sapphire Rapids or later)")


def bf16_reference(x: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x @ W^T over the bf16-rounded operands, and the sum of the terms' magnitudes."""
    xb, wb = x.bfloat16().double(), dense.bfloat16().double()
    return xb @ wb.T, xb.abs() @ wb.abs().T


def assert_fp32_sum_of(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= 1e-5 * magnitude + 1e-30).all()), f"max error {(err / (magnitude + 1e-30)).max().item():.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 17, 33, 130])  # one, partial row tiles, an odd count of tiles
def test_bf16_kernel_is_fp32_sums_of_the_bf16_rounded_operands(fmt, rows):
    blocks, dense = blocks_and_reference(fmt, 40, 512, seed=int(fmt))  # 40: a partial group of 16 features
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    want, magnitude = bf16_reference(x, dense)
    assert_fp32_sum_of(torch.ops.kvserve.gguf_linear_bf16(x, own_layout(blocks), 40, int(fmt)), want, magnitude)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("K", [512, 1280])  # one K block; two, the second partial
def test_the_decoded_weights_are_the_exact_decoders_values_rounded_to_bf16(fmt, K):
    """One-hot rows read the weights back: x = I makes each output one product 1 x w, exact in the
    tiles' fp32, so y = W^T as the kernel decoded it, bit for bit. It must be gguf's own dequantized
    values rounded to nearest even: a decoder one bf16 step off on one weight (the straight Q4_K / Q6_K
    decode, or the others' fp32 path) fails here, where the sums' tolerance above could miss it."""
    blocks, dense = blocks_and_reference(fmt, 40, K, seed=int(fmt) + K)
    got = torch.ops.kvserve.gguf_linear_bf16(torch.eye(K), own_layout(blocks), 40, int(fmt))
    assert torch.equal(got, dense.bfloat16().float().T)


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_K, BlockFormat.Q6_K, BlockFormat.Q8_0])
def test_k_past_one_accumulation_block(fmt):
    """K = 1,280: two K blocks of the kernel (1,024 + 256), the second accumulating onto the first."""
    blocks, dense = blocks_and_reference(fmt, 48, 1280, seed=11)
    x = torch.randn(40, 1280, generator=torch.Generator().manual_seed(11))
    want, magnitude = bf16_reference(x, dense)
    assert_fp32_sum_of(torch.ops.kvserve.gguf_linear_bf16(x, own_layout(blocks), 48, int(fmt)), want, magnitude)


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_K, BlockFormat.Q6_K, BlockFormat.Q4_1])
def test_swiglu_is_silu_of_the_gate_times_up(fmt):
    """A gate/up matrix of 2 x 40 features (gate first): [rows, 40] = SiLU(gate) * up, the same
    products as the plain kernel's two halves."""
    blocks, dense = blocks_and_reference(fmt, 80, 512, seed=5)
    packed = own_layout(blocks)
    x = torch.randn(130, 512, generator=torch.Generator().manual_seed(5))
    got = torch.ops.kvserve.gguf_swiglu_bf16(x, packed, 40, int(fmt))
    both = torch.ops.kvserve.gguf_linear_bf16(x, packed, 80, int(fmt))
    torch.testing.assert_close(got, F.silu(both[:, :40]) * both[:, 40:], rtol=1e-5, atol=1e-6)
    want, _ = bf16_reference(x, dense)
    ref = F.silu(want[:, :40]) * want[:, 40:]
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_K, BlockFormat.Q5_0])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(fmt):
    """Each output sums its own row's products in a fixed order: the same bits alone or in a batch."""
    blocks, _ = blocks_and_reference(fmt, 40, 512, seed=2)
    packed = own_layout(blocks)
    x = torch.randn(130, 512, generator=torch.Generator().manual_seed(2))
    full = torch.ops.kvserve.gguf_linear_bf16(x, packed, 40, int(fmt))
    for r in (0, 17, 129):
        assert torch.equal(torch.ops.kvserve.gguf_linear_bf16(x[r:r + 1].contiguous(), packed, 40, int(fmt)),
                           full[r:r + 1])


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_K, BlockFormat.Q8_0])
def test_out_writes_the_same_bits_into_a_column_slice_and_nothing_else(fmt):
    """gguf_linear_bf16_out into columns [8, 48) of a wider tensor: gguf_linear_bf16's bits there,
    the other columns as they were."""
    blocks, _ = blocks_and_reference(fmt, 40, 512, seed=4)
    packed = own_layout(blocks)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(4))
    wide = torch.randn(33, 64)
    before = wide.clone()
    torch.ops.kvserve.gguf_linear_bf16_out(x, packed, 40, int(fmt), wide[:, 8:48])
    assert torch.equal(wide[:, 8:48], torch.ops.kvserve.gguf_linear_bf16(x, packed, 40, int(fmt)))
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 48:], before[:, 48:])
    with pytest.raises(RuntimeError, match=r"out must be a \[33, 40\] float32 CPU tensor with unit column stride"):
        torch.ops.kvserve.gguf_linear_bf16_out(x, packed, 40, int(fmt), wide[:, 8:48].t().contiguous().t())


def test_bad_shapes_are_clear_errors():
    blocks, _ = blocks_and_reference(BlockFormat.Q4_K, 32, 256)
    with pytest.raises(RuntimeError, match="do not hold 32 x 512"):
        torch.ops.kvserve.gguf_linear_bf16(torch.randn(1, 512), blocks.data, 32, int(BlockFormat.Q4_K))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.kvserve.gguf_swiglu_bf16(torch.randn(1, 256), blocks.data, 12, int(BlockFormat.Q4_K))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve.gguf_linear_bf16(torch.randn(1, 256).double(), blocks.data, 32, int(BlockFormat.Q4_K))
