"""int8 activations (``activation_quant: int8``, engine/kernels/cpu/quant_linear_q8.cpp).

Kernel: its output must equal an independent oracle: the activations quantized by the tiny
Python quantizer below (per 32-block: d = max|x| / 127, q = round-half-even(x / d) as x * (1/d)
in fp32), dequantized, times gguf's own dequantization of the weights, in float64. The kernel's
integer dot products are exact, so only fp32 rounding of the per-block terms remains (~1e-6
relative; a mis-paired code or scale is O(1)). Against F.linear on the fp32 activations the
error is bounded by the activations' rounding, |x - d q| <= d / 2 per element, so
|y_int8 - y_fp32| <= sum_k |W[n, k]| d_k / 2 (plus the fp32 slack): a bound that holds for any
correct kernel and that a wrong one misses by orders of magnitude.

Engine: the flag on, the native decode path serves a tiny random GGUF model; its logits at
every step are within the activations' rounding of the flag-off engine's, and not equal to them
(the flag must change the numerics it claims to).
"""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.loader.gguf.blocks import BlockFormat, BlockMatrix, GGUFMatrix

from engine.model.block_linear import BlockLinear
from tests.helpers import require_native_kernel

GGML = {BlockFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1, BlockFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()
    if not torch.ops.kvserve.gguf_q8_supported(int(BlockFormat.Q4_1)):
        pytest.skip("no AVX2: the int8-activation kernels do not run on this CPU (the flag falls back to fp32)")


def quantize_reference(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] as float, scales [M, K / block]): the contract of kvserve::Q8Act in torch."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return q.reshape(m, k), d.reshape(m, k // block)


def activation_block(fmt: BlockFormat) -> int:
    """The activations' quantization block for a weight format: per 256 for the K-quants (llama.cpp's Q8_K)."""
    return 256 if fmt in (BlockFormat.Q4_K, BlockFormat.Q5_K, BlockFormat.Q6_K) else 32


# the formats with an int8 kernel: Q4_1 and Q5_0 strips (passes of 16 rows, then 8, 4, 2, 1), Q8_0
# strips (8, 4, 2, 1), Q4_K / Q5_K / Q6_K rows (16 per pass; two features at a time on AVX512-VNNI,
# and there Q4_K from 4 rows and Q6_K from 8 16 features at a time, passes of 4, 2, 1 rows, the rest of a
# thread's features two or one at a time; on AVX2 alone the same from the same row counts 8 features at a
# time (Q4_K: two groups of 8 a pass where two are left), passes of 4, 2, 1 rows, the rest one at a
# time: the 40 features of the row-independence test below end on a lone group), Q4_0 / Q5_1 rows (16 per pass)
INT8_FORMATS = [BlockFormat.Q4_1, BlockFormat.Q8_0, BlockFormat.Q4_K, BlockFormat.Q6_K, BlockFormat.Q4_0,
                BlockFormat.Q5_0, BlockFormat.Q5_1, BlockFormat.Q5_K]


def random_matrix(fmt: BlockFormat, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed data, gguf's own dequantization) of random valid blocks (random codes and
    sub-scales, finite scales: bench.make_gguf, as the format tests use)."""
    from bench.make_gguf import random_blocks

    raw = random_blocks(fmt, rows, cols, np.random.default_rng(seed))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, fmt.ggml_type).reshape(rows, cols)).float()
    # fmt's own kernel: strips for the strip formats, else the GGUF rows
    data = torch.from_numpy(raw.copy())
    return (GGUFMatrix(data, fmt, cols).pack().data if fmt.strips else data), dense


@pytest.mark.parametrize("block", [32, 256])
def test_quantizer_matches_the_reference(block):
    x = torch.randn(5, 3 * block, generator=torch.Generator().manual_seed(0)) * 3
    x[1, block : 2 * block] = 0  # an all-zero block: scale 0, codes 0
    x[2, 0] = 127  # scale 1: the other values, all halves, round half to even
    x[2, 1:block] = torch.arange(block - 1) % 20 - 9.5
    codes, scales = torch.ops.kvserve.quantize_q8(x, block)
    want_q, want_d = quantize_reference(x, block)
    assert torch.equal(codes.float(), want_q) and torch.equal(scales, want_d)
    assert codes.abs().max() == 127 and torch.all(codes[1, block : 2 * block] == 0)
    assert torch.equal(codes[2, 1:5], torch.tensor([-10, -8, -8, -6], dtype=torch.int8))


@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])  # rows per pass 8 (strips) / 16 (rows), and remainders
@pytest.mark.parametrize("out_features", [37, 64])  # 37: the last strip of 8 columns is partial
def test_kernel_equals_the_quantized_oracle_and_stays_within_the_rounding_bound(fmt, rows, out_features):
    check_against_oracle(fmt, rows, out_features)


def test_amx_tiles_equal_the_avx512_kernels_bit_for_bit(tmp_path):
    """On AMX CPUs the int8 matmuls of many rows take tile products (quant_linear_amx.cpp): the
    K-quants from kAmxMinRows (32) with the sub-block scales folded into the codes, Q4_1, Q5_0 and
    Q8_0 from kAmxStripMinRows (32) one product per 32-block of a strip pair. They sum the same integers and run the same
    float operations as the AVX-512 kernels, so every output is the same float. The reference runs
    in a subprocess with KVSERVE_NO_AMX (read once per process). 45 features: whole groups of 16
    (strip pairs) and a remainder on the other kernel; 33 and 70 rows: whole tiles and a partial
    one, and 15, 16 and 17 rows, below both thresholds. K = 768: three super-blocks, a slab of two and a slab of one;
    K = 800: 25 blocks of 32, two in flight and a last one alone."""
    if not torch.ops.kvserve.gguf_q8_amx():
        pytest.skip("this CPU (or OS) has no AMX-INT8: the tile kernels do not run here")
    row_counts = (15, 16, 17, 33, 70)
    cases = {}
    for fmt in (BlockFormat.Q4_K, BlockFormat.Q5_K, BlockFormat.Q6_K, BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0):
        K, block = (768, 256) if activation_block(fmt) == 256 else (800, 32)
        packed, dense = random_matrix(fmt, 45, K, seed=int(fmt) + 7)
        x = torch.randn(70, K, generator=torch.Generator().manual_seed(int(fmt))) * 2
        got = [torch.ops.kvserve.gguf_linear_q8(x[:m], packed, 45, int(fmt)) for m in row_counts]
        cases[int(fmt)] = (packed, x, got)
        # and against the oracle: F.linear on the quantized activations and gguf's dequantization
        q, d = quantize_reference(x, block)
        oracle = F.linear((q.reshape(70, -1, block) * d[..., None]).reshape(70, K).double(), dense.double())
        torch.testing.assert_close(got[-1].double(), oracle, rtol=1e-5, atol=1e-5 * oracle.abs().max().item())
    torch.save(cases, tmp_path / "cases.pt")
    script = f"""
import torch
from engine.kernels import load_kernels
assert load_kernels() and not torch.ops.kvserve.gguf_q8_amx()
for fmt, (packed, x, want) in torch.load({str(tmp_path / "cases.pt")!r}).items():
    for m, w in zip({row_counts!r}, want):
        got = torch.ops.kvserve.gguf_linear_q8(x[:m], packed, 45, fmt)
        assert torch.equal(got, w), (fmt, m, (got - w).abs().max())
print("ok")
"""
    env = {**os.environ, "KVSERVE_NO_AMX": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_1, BlockFormat.Q4_K, BlockFormat.Q6_K, BlockFormat.Q5_1,
                                 BlockFormat.Q5_K])
@pytest.mark.parametrize("rows", [16, 31, 33])  # one full pass of 16 rows; 16 + 8 + 4 + 2 + 1; two and a single row
def test_sixteen_row_kernels_at_a_full_pass_and_beyond(fmt, rows):
    check_against_oracle(fmt, rows, 37)


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_pass(fmt):
    """Each row runs the same operations in the same order whatever the row count (single-row
    and many-row code paths alike), so batching never changes a sequence's logits."""
    packed, _ = random_matrix(fmt, 40, 512, seed=3)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(3))
    together = torch.ops.kvserve.gguf_linear_q8(x, packed, 40, int(fmt))
    for r in (0, 7, 15, 16, 32):
        assert torch.equal(together[r], torch.ops.kvserve.gguf_linear_q8(x[r : r + 1], packed, 40, int(fmt))[0])


def check_against_oracle(fmt: BlockFormat, rows: int, out_features: int) -> None:
    packed, dense = random_matrix(fmt, out_features, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.kvserve.gguf_linear_q8(x, packed, out_features, int(fmt))
    block = activation_block(fmt)
    q, d = quantize_reference(x, block)
    x_deq = (q.reshape(rows, -1, block) * d[..., None]).reshape(rows, 512)
    oracle = F.linear(x_deq.double(), dense.double())
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-5 * oracle.abs().max().item())
    # against fp32 activations: within the rounding bound, and not equal (the int8 path ran)
    exact = F.linear(x.double(), dense.double())
    bound = F.linear(d.repeat_interleave(block, dim=1).double() / 2, dense.abs().double())
    assert torch.all((got.double() - exact).abs() <= bound + 1e-4)
    assert (got.double() - exact).abs().max() > 1e-5 * exact.abs().max()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 33])  # passes of 16, 8, 4, 2, 1
@pytest.mark.parametrize("out_features", [37, 64])  # 37: a partial last strip, a lone full one beside pairs
def test_q5_0_strips_hold_the_files_bytes_and_run_the_int8_kernel(rows, out_features):
    """GGUFMatrix.pack regroups Q5_0 matrices into strips of the same 22 bytes a block (176 a
    strip-block: d, Q4_1's nibbles, the fifth bits; until issue 39 they became Q8_0 strips of 34),
    which dequantize to gguf's own Q5_0 values bit for bit; BlockLinear runs the Q5_0 strip kernel
    on them and the result equals the quantized oracle on gguf's Q5_0 dequantization."""
    from bench.make_gguf import random_blocks

    raw = random_blocks(BlockFormat.Q5_0, out_features, 512, np.random.default_rng(rows))
    q5_0 = GGUFMatrix(torch.from_numpy(raw.copy()), BlockFormat.Q5_0, 512)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0).reshape(out_features, 512))
    packed = q5_0.pack()
    assert packed.format == BlockFormat.Q5_0 and packed.nbytes == (out_features + 7) // 8 * 16 * 176
    assert torch.equal(packed.dequantize(), dense.float())
    assert torch.equal(q5_0.data, torch.from_numpy(raw))  # the file's blocks are left as they are
    linear = BlockLinear(packed, None, None, int8_activations=True)
    assert linear.kernels == [torch.ops.kvserve.gguf_linear_q8] and linear.parts[0][2] == int(BlockFormat.Q5_0)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = linear(x)
    q, d = quantize_reference(x)
    oracle = F.linear((q.reshape(rows, -1, 32) * d[..., None]).reshape(rows, 512).double(), dense.double())
    torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-5 * oracle.abs().max().item())


def test_vnni_kernels_equal_the_avx2_ones_bit_for_bit(tmp_path):
    """On AVX512-VNNI, Q4_1 and Q8_0 run strip pairs in 512-bit registers (vpdpbusd; Q8_0's
    codes offset by 128 and the column sums taken off) and a lone or partial strip on AVX2, and
    the K-quants' many-row passes take vpdpbusd and their one-row kernels 512-bit registers (in
    -march=native builds); all sum the same integers as the AVX2 kernels, so every output is the
    same float. The AVX2 side runs in a
    subprocess with KVSERVE_NO_VNNI (read once per process). 45 features: two pairs, a lone full
    strip and a partial one; rows 1-17 cover the 16/8/4/2/1 passes (K-quants: 16 and 1)."""
    if torch.ops.kvserve.gguf_q8_isa() != "vnni":
        pytest.skip("this CPU has no AVX512-VNNI: the VNNI kernels do not run here")
    cases = {}
    for fmt, width in ((BlockFormat.Q4_1, 128), (BlockFormat.Q8_0, 128), (BlockFormat.Q4_K, 512),
                       (BlockFormat.Q6_K, 512), (BlockFormat.Q5_0, 128), (BlockFormat.Q5_K, 512)):
        packed, _ = random_matrix(fmt, 45, width, seed=int(fmt))
        x = torch.randn(17, width, generator=torch.Generator().manual_seed(int(fmt)))
        cases[int(fmt)] = (packed, x, [torch.ops.kvserve.gguf_linear_q8(x[:m], packed, 45, int(fmt))
                                       for m in range(1, 18)])
    torch.save(cases, tmp_path / "cases.pt")
    script = f"""
import torch
from engine.kernels import load_kernels
assert load_kernels() and torch.ops.kvserve.gguf_q8_isa() == "avx2"
for fmt, (packed, x, want) in torch.load({str(tmp_path / "cases.pt")!r}).items():
    for m in range(1, 18):
        got = torch.ops.kvserve.gguf_linear_q8(x[:m], packed, 45, fmt)
        assert torch.equal(got, want[m - 1]), (fmt, m, (got - want[m - 1]).abs().max())
print("ok")
"""
    env = {**os.environ, "KVSERVE_NO_VNNI": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("has_dense", [True, False], ids=["dense-copy", "blocks-only"])
def test_prefill_sized_calls_take_the_int8_kernel_where_it_wins(fmt, has_dense):
    """With int8 activations, a call over 16 rows (a prefill chunk) runs the int8 block kernel
    for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K on every CPU with one (AVX2 or better: they beat or match
    dense fp32 GEMM at prefill row counts, and a row's result then does not depend on how many rows
    share its call), and for Q5_K too without a dense copy (the fp32 panels are slower; Q4_0 / Q5_1's
    row kernel is not); the dense fp32 copy or the panels everywhere else."""
    from bench.make_gguf import random_blocks

    raw = random_blocks(fmt, 40, 256, np.random.default_rng(7))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, fmt.ggml_type).reshape(40, 256)).float()
    packed = GGUFMatrix(torch.from_numpy(raw.copy()), fmt, 256).pack()
    calls = []
    fallback = (lambda x: calls.append(len(x)) or F.linear(x, dense)) if has_dense else None
    linear = BlockLinear(packed, None, fallback, int8_activations=True)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(7))
    got = linear(x)
    prefill = fmt in (BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0, BlockFormat.Q4_K, BlockFormat.Q6_K)
    over_panels = fmt in (BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0, BlockFormat.Q4_K, BlockFormat.Q5_K,
                          BlockFormat.Q6_K)
    if prefill or (not has_dense and over_panels):
        assert linear.max_rows == sys.maxsize and calls == []
        assert torch.equal(got, torch.ops.kvserve.gguf_linear_q8(x, packed.data, 40, int(fmt)))
    elif has_dense:
        assert linear.max_rows == BlockLinear.INT8_MAX_ROWS and calls == [70]
        assert torch.equal(got, F.linear(x, dense))
    else:  # blocks only: the fp32 panels
        assert linear.max_rows == BlockLinear.INT8_MAX_ROWS
        assert torch.equal(got, torch.ops.kvserve.gguf_linear_panels(x, packed.data, 40, int(fmt), linear.tile_rows))
    linear.use_int8_activations(False)  # fp32 activations: prefill back on the dense copy or the panels
    assert linear.max_rows == (BlockLinear.MAX_ROWS[fmt] if has_dense
                               else max(BlockLinear.MAX_ROWS[fmt], BlockLinear.BLOCKS_ONLY_MAX_ROWS))
    torch.testing.assert_close(linear(x), F.linear(x, dense), rtol=1e-4, atol=1e-4)


def test_cpus_without_an_int8_kernel_keep_fp32_activations(tmp_path):
    """Every quantized block format has an int8 kernel on AVX2 (F16 and BF16 keep fp32
    activations, as llama.cpp multiplies them in floats too); where the CPU has none (forced here
    by KVSERVE_PORTABLE_KERNELS, read once per process) the flag leaves fp32 activations and the
    op refuses with a clear error. The scalar quantizer there gives the AVX2 one's codes and scales."""
    halves = {BlockFormat.F16, BlockFormat.BF16}
    assert all(torch.ops.kvserve.gguf_q8_supported(int(f)) != (f in halves) for f in BlockFormat)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11)) * 3
    torch.save({"x": x, **{b: torch.ops.kvserve.quantize_q8(x, b) for b in (32, 256)}}, tmp_path / "q.pt")
    script = f"""
import numpy as np, torch, gguf, pytest
from engine.kernels import load_kernels
from engine.loader.gguf.blocks import BlockFormat, BlockMatrix, GGUFMatrix
from engine.model.block_linear import BlockLinear
assert load_kernels() and torch.ops.kvserve.gguf_q8_isa() == "none"
assert not any(torch.ops.kvserve.gguf_q8_supported(int(f)) for f in BlockFormat)
q5_k = GGUFMatrix(torch.zeros(8, 176, dtype=torch.uint8), BlockFormat.Q5_K, 256)  # d = 0: valid blocks
linear = BlockLinear(BlockMatrix.stack([q5_k]), None, None, int8_activations=True)
assert linear.kernels == [torch.ops.kvserve.gguf_linear] and linear.swiglu_args is None
assert torch.equal(linear(torch.randn(2, 256)), torch.zeros(2, 8))
with pytest.raises(RuntimeError, match="no int8-activation kernel for format 4"):
    torch.ops.kvserve.gguf_linear_q8(torch.randn(1, 256), torch.zeros(1, 176, dtype=torch.uint8), 1, 4)
want = torch.load({str(tmp_path / "q.pt")!r})
for block in (32, 256):
    got = torch.ops.kvserve.quantize_q8(want["x"], block)
    assert all(torch.equal(a, b) for a, b in zip(got, want[block])), block
print("ok")
"""
    env = {**os.environ, "KVSERVE_PORTABLE_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_flag_is_validated():
    from engine.config import ModelConfig
    from tests.helpers import tiny_engine, tiny_hf_model

    with pytest.raises(ValueError, match="activation_quant must be auto, none or int8"):
        ModelConfig(activation_quant="fp8")
    model = tiny_engine(tiny_hf_model()).runner.model  # dense safetensors-style weights: no blocks
    model.activation_quant = "int8"
    with pytest.raises(ValueError, match="activation_quant 'int8' needs the gguf linear backend"):
        model.select_linear_backend("auto")


def _engine(path, mode: str | None, kv_cache_dtype: str | None = "float32", prefill_attention_dtype: str = "auto"):
    """``mode`` / ``kv_cache_dtype`` None: the defaults (auto, auto); else the flags as given
    (``none`` with ``float32``: the exact flags)."""
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    model = {} if mode is None else {"activation_quant": mode}
    cache = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), num_threads=1, prefill_attention_dtype=prefill_attention_dtype, **model),
        cache=CacheConfig(block_size=4, num_blocks=64, **cache), scheduler=SchedulerConfig(max_num_seqs=4)))


@pytest.mark.parametrize("flags", ["int8", "defaults"])  # defaults: int8 activations and fp16 KV
@pytest.mark.parametrize("fmt", [BlockFormat.Q4_1, BlockFormat.Q8_0, "Q4_K_M", BlockFormat.Q5_0])
def test_native_decode_with_int8_activations_tracks_fp32(fmt, flags, tmp_path, monkeypatch):
    """Greedy decode of 3 streams on the exact engine (fp32 activations and KV) and on the one
    under test: ``int8`` (the opt-in flag, fp32 KV) or the defaults (``auto``: int8 activations,
    fp16 KV, llama.cpp's numerics); logits compared step by step while the tokens agree.
    Tolerance 5% of the largest logit: 2 layers of 8-bit activations (relative rounding <= 1/254
    per element, ~0.3% per matmul on random weights) through 7 matmuls; fp16 K/V round at 2^-11."""
    from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
    from kvtypes.sampling_params import SamplingParams

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shape = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)
    formats = q4_k_m if fmt == "Q4_K_M" else (lambda name, layer, layers: fmt)  # Q4_K_M: Q4_K and Q6_K parts
    path = write_gguf(tmp_path / "tiny.gguf", shape, formats, seed=3)
    logits, native_calls = {}, {}
    for mode in ("none", "int8"):
        engine = _engine(path, mode) if mode == "none" or flags == "int8" else _engine(path, None, None)
        model = engine.runner.model
        assert model.decode_path == "native" and model.activation_quant == mode
        assert engine.info.kv_cache_dtype == ("float16" if mode == "int8" and flags == "defaults" else "auto")
        seen, calls = [], [0]
        compute, native = model.compute_logits, model.native_decode
        model.compute_logits = lambda h, f=compute: seen.append(f(h).clone()) or seen[-1]
        model.native_decode = lambda *a, f=native, **kw: calls.__setitem__(0, calls[0] + 1) or f(*a, **kw)
        out = engine.generate([[5, 6, 7], [9, 3, 4, 8], [11]], SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True))
        logits[mode] = (seen, [o.token_ids for o in out])
        native_calls[mode] = calls[0]
        if mode == "int8":  # every block matrix of these formats takes the int8 kernel; switching is cheap
            assert model.describe_activation_quant().startswith("int8 for ")
            assert all(op is torch.ops.kvserve.gguf_linear_q8 for mm in model.block_linears() for op in mm.kernels)
            model.set_activation_quant("none")
            assert all(op is torch.ops.kvserve.gguf_linear for mm in model.block_linears() for op in mm.kernels)
    assert native_calls["int8"] > 0 and native_calls["none"] > 0  # decode steps ran the native layer
    (ref, ref_tokens), (got, got_tokens) = logits["none"], logits["int8"]
    compared = 0
    for a, b in zip(ref, got):
        if a.shape != b.shape:
            break
        torch.testing.assert_close(b, a, rtol=0, atol=0.05 * a.abs().max().item())
        compared += 1
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break  # the next inputs differ: nothing more to compare
    assert compared >= 2
    print(f"{fmt}: {compared} steps compared, tokens equal: {ref_tokens == got_tokens}, max |diff| "
          f"{max((a - b).abs().max().item() for a, b in zip(ref[:compared], got[:compared])):.4f} of "
          f"{max(a.abs().max().item() for a in ref):.2f}")
    assert max((a - b).abs().max().item() for a, b in zip(ref[:compared], got[:compared])) > 0


@pytest.mark.parametrize("fmt", [BlockFormat.F16, BlockFormat.BF16])
def test_unquantized_halves_keep_fp32_activations_under_the_int8_flag(fmt, tmp_path, monkeypatch):
    """F16 / BF16 matrices have no int8 kernel (llama.cpp multiplies them in floats as well):
    with the flag on, every one keeps the fp32 kernel and the logits are the flag-off logits
    bit for bit, decode on the native path."""
    from bench.make_gguf import GGUFShape, write_gguf
    from kvtypes.sampling_params import SamplingParams

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shape = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)
    path = write_gguf(tmp_path / "tiny.gguf", shape, lambda name, layer, layers: fmt, seed=3)
    logits = {}
    for mode in ("none", "int8"):
        engine = _engine(path, mode, prefill_attention_dtype="float32")  # the matmuls alone differ
        model = engine.runner.model
        assert model.decode_path == "native" and model.activation_quant == mode
        assert all(op is torch.ops.kvserve.gguf_linear for mm in model.block_linears() for op in mm.kernels)
        seen = []
        compute = model.compute_logits
        model.compute_logits = lambda h, f=compute: seen.append(f(h).clone()) or seen[-1]
        engine.generate([[5, 6, 7], [9, 3, 4, 8]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        logits[mode] = seen
    assert len(logits["none"]) == len(logits["int8"]) >= 5
    assert all(torch.equal(a, b) for a, b in zip(logits["none"], logits["int8"]))


@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("rows", [1, 17, 70])
def test_fused_gate_up_equals_silu_of_the_gate_times_the_up(fmt, rows):
    """gguf_swiglu_q8 (the MLP's gate/up matmul and SiLU * up in one pass, no [rows, 2I]
    product) against gguf_linear_q8 on the same packed [2I, K] matrix, split and combined by
    torch. I = 136: two chunks of 64 features and a partial one of 8; gate and up must not be
    swapped or shifted (a shifted column is O(1) off)."""
    intermediate = 136
    packed, _ = random_matrix(fmt, 2 * intermediate, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    both = torch.ops.kvserve.gguf_linear_q8(x, packed, 2 * intermediate, int(fmt))
    want = F.silu(both[:, :intermediate]) * both[:, intermediate:]
    got = torch.ops.kvserve.gguf_swiglu_q8(x, packed, intermediate, int(fmt))
    assert got.shape == (rows, intermediate)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item())


def test_block_linear_fuses_the_gate_up_only_where_one_int8_kernel_runs():
    from bench.make_gguf import random_blocks

    fmt, intermediate = BlockFormat.Q4_K, 64
    raw = random_blocks(fmt, 2 * intermediate, 256, np.random.default_rng(5))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, fmt.ggml_type).reshape(2 * intermediate, 256)).float()
    matrix = GGUFMatrix(torch.from_numpy(raw.copy()), fmt, 256)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(5))
    blocks_only = BlockLinear(matrix.pack(), None, None, int8_activations=True)
    got = blocks_only.swiglu(x)
    gate, up = blocks_only(x).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-5)
    with_dense = BlockLinear(matrix.pack(), None, lambda t: F.linear(t, dense), int8_activations=True)
    assert with_dense.swiglu(x[:16]) is not None
    assert with_dense.swiglu(x) is not None  # 20 rows: Q4_K's int8 kernel beats dense GEMM
    q5_k = random_blocks(BlockFormat.Q5_K, 2 * intermediate, 256, np.random.default_rng(6))
    q5_k_dense = torch.from_numpy(gguf.quants.dequantize(q5_k, BlockFormat.Q5_K.ggml_type).reshape(-1, 256)).float()
    q5_k_linear = BlockLinear(GGUFMatrix(torch.from_numpy(q5_k.copy()), BlockFormat.Q5_K, 256).pack(), None,
                              lambda t: F.linear(t, q5_k_dense), int8_activations=True)
    assert q5_k_linear.swiglu(x[:16]) is not None
    assert q5_k_linear.swiglu(x) is None  # 20 rows: Q5_K's prefill runs on the dense copy
    assert BlockLinear(matrix.pack(), None, None, int8_activations=False).swiglu(x) is None  # fp32 panels
    halves = [GGUFMatrix(torch.from_numpy(raw[i * intermediate:(i + 1) * intermediate].copy()), fmt, 256).pack()
              for i in range(2)]
    assert BlockLinear(BlockMatrix(halves), None, None, int8_activations=True).swiglu(x) is None  # two parts
