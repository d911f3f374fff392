"""Every GGUF block format the kernel reads, against gguf's own dequantization, and GGUF files
in each format loaded by kvserve against transformers reading the same file.

Matrices are random block bytes with finite random fp16 scales (``bench.make_gguf``): gguf-py
cannot quantize the K formats, and any such block is valid; gguf's ``dequantize`` says what
it means."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.make_gguf import GGUFShape, random_blocks, write_gguf
from engine.loader.gguf.blocks import BlockFormat, GGUFMatrix
from engine.model.block_linear import BlockLinear
from tests.helpers import require_native_kernel

FORMATS = list(BlockFormat)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def blocks_and_reference(fmt: BlockFormat, rows: int, cols: int, seed: int = 0) -> tuple[GGUFMatrix, torch.Tensor]:
    raw = random_blocks(fmt, rows, cols, np.random.default_rng(seed))
    dense = gguf.quants.dequantize(raw, fmt.ggml_type).reshape(rows, cols)
    return GGUFMatrix(torch.from_numpy(raw), fmt, cols), torch.from_numpy(np.ascontiguousarray(dense))


def own_layout(blocks: GGUFMatrix) -> torch.Tensor:
    """The bytes the kernel of ``blocks.format`` itself reads: strips for Q4_1 / Q5_0 / Q8_0, else
    the GGUF rows."""
    return blocks.pack().data if blocks.format.strips else blocks.data


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 summation order: relative to the size of the terms summed."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [37, 64])  # 37: a partial strip of 8 columns
def test_kernel_values_are_ggufs_bit_for_bit(fmt, rows):
    blocks, dense = blocks_and_reference(fmt, rows, 512)
    assert torch.equal(blocks.pack().dequantize(), dense)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_f_linear_for_every_row_count(fmt):
    """Rows 1-33 through the block kernel (every row-group size and remainder), N = 37 so the
    last strip is partial; the panel path (block-only prefill) at a few row counts too."""
    blocks, dense = blocks_and_reference(fmt, 37, 512, seed=int(fmt))
    packed = own_layout(blocks)
    gen = torch.Generator().manual_seed(int(fmt))
    for rows in range(1, 34):
        x = torch.randn(rows, 512, generator=gen)
        got = torch.ops.kvserve.gguf_linear(x, packed, 37, int(fmt))
        assert got.shape == (rows, 37)
        close(got, F.linear(x, dense))
    for rows, tile in ((1, 8), (17, 16), (40, 64)):
        x = torch.randn(rows, 512, generator=gen)
        close(torch.ops.kvserve.gguf_linear_panels(x, packed, 37, int(fmt), tile), F.linear(x, dense))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not f.strips])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(fmt):
    """Above 4 rows the row formats' kernel keeps one accumulator per (row, feature) over all of
    K: a row's outputs are the same bits in any batch of 5-16 rows, wherever it sits."""
    blocks, _ = blocks_and_reference(fmt, 37, 512, seed=7)
    packed = own_layout(blocks)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(7))
    full = torch.ops.kvserve.gguf_linear(x, packed, 37, int(fmt))
    for rows in range(5, 16):
        for start in (0, 16 - rows):
            part = torch.ops.kvserve.gguf_linear(x[start:start + rows].contiguous(), packed, 37, int(fmt))
            assert torch.equal(part, full[start:start + rows]), (rows, start)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_linear_without_a_dense_copy(fmt):
    blocks, dense = blocks_and_reference(fmt, 24, 256, seed=3)
    bias = torch.randn(24)
    linear = BlockLinear(blocks.pack(), bias, None)
    assert linear.dense is None  # every row count below runs from the blocks (kernel or panels)
    for rows in (1, linear.max_rows, linear.max_rows + 1, 50):
        x = torch.randn(rows, 256)
        close(linear(x), F.linear(x, dense, bias))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_lookup_equals_the_dequantized_rows(fmt):
    """The embedding lookup of block-only models decodes just the rows asked for."""
    blocks, dense = blocks_and_reference(fmt, 37, 256, seed=5)
    packed = own_layout(blocks)
    ids = torch.tensor([0, 36, 9, 9, 17, 8])
    assert torch.equal(torch.ops.kvserve.gguf_rows(packed, 37, 256, int(fmt), ids), dense[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvserve.gguf_rows(packed, 37, 256, int(fmt), torch.tensor([37]))


def test_bad_format_and_shape_are_clear_errors():
    blocks, _ = blocks_and_reference(BlockFormat.Q4_K, 4, 256)
    unknown = len(BlockFormat)
    with pytest.raises(RuntimeError, match=f"format must be 0-{unknown - 1} "):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 256), blocks.data, 4, unknown)
    with pytest.raises(RuntimeError, match="do not hold 4 x 512"):
        torch.ops.kvserve.gguf_linear(torch.randn(1, 512), blocks.data, 4, int(BlockFormat.Q4_K))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.kvserve.gguf_linear_panels(torch.randn(1, 256), blocks.data, 4, int(BlockFormat.Q4_K), 12)
    with pytest.raises(ValueError, match="not Q6_K rows of 256"):
        GGUFMatrix(blocks.data, BlockFormat.Q6_K, 256)


def test_portable_path_equals_f_linear():
    """The loops non-AVX2 CPUs run, every format (KVSERVE_PORTABLE_KERNELS is read once per process)."""
    script = """
import numpy as np, gguf, torch, torch.nn.functional as F
from engine.kernels import load_kernels
from engine.loader.gguf.blocks import BlockFormat, GGUFMatrix
from bench.make_gguf import random_blocks
assert load_kernels() and torch.ops.kvserve.gguf_kernel_isa() == "portable"
for fmt in BlockFormat:
    raw = random_blocks(fmt, 37, 512, np.random.default_rng(int(fmt)))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, fmt.ggml_type).reshape(37, 512).copy())
    blocks = GGUFMatrix(torch.from_numpy(raw), fmt, 512)
    packed = blocks.pack()
    assert torch.equal(packed.dequantize(), dense), fmt
    layouts = [(packed.data, int(packed.format))]
    for rows in (1, 9):
        x = torch.randn(rows, 512)
        want = F.linear(x, dense)
        tol = 1e-5 * max(1.0, want.abs().max().item())
        for data, code in layouts:
            for got in (torch.ops.kvserve.gguf_linear(x, data, 37, code),
                        torch.ops.kvserve.gguf_linear_panels(x, data, 37, code, 16)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=tol)
print("ok")
"""
    env = {**os.environ, "KVSERVE_PORTABLE_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---- whole GGUF files -------------------------------------------------------------------------------
TINY = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Conversions of the test files go to a temporary cache (the kernels are already loaded)."""
    folder = tmp_path_factory.mktemp("kvserve-cache")
    old = os.environ.get("KVSERVE_CACHE_DIR")
    os.environ["KVSERVE_CACHE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("KVSERVE_CACHE_DIR", None)
    else:
        os.environ["KVSERVE_CACHE_DIR"] = old


def gguf_engine(path, resident: str = "blocks", linear_backend: str = "auto"):
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    from tests.helpers import EXACT_CACHE_FLAGS, EXACT_MODEL_FLAGS

    # the exact flags (fp32 activations and KV): the tests compare with transformers and path with path
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), num_threads=1, weights_resident=resident, linear_backend=linear_backend,
                          **EXACT_MODEL_FLAGS),
        cache=CacheConfig(block_size=4, num_blocks=128, **EXACT_CACHE_FLAGS),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)))


def hf_from_gguf(path):
    """transformers reading the same file: its own dequantization and q/k row order."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def uniform(fmt: BlockFormat):
    return lambda name, layer, layers: fmt


CASES = {f"llama-{f.name}": (TINY, f) for f in FORMATS} | {
    "qwen2-Q4_K": (GGUFShape(**{**TINY.__dict__, "arch": "qwen2"}), BlockFormat.Q4_K),
    "qwen2-Q8_0-tied": (GGUFShape(**{**TINY.__dict__, "arch": "qwen2", "tie": True}), BlockFormat.Q8_0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_file_logits_equal_transformers(case, cache_dir, tmp_path):
    """A tiny model written as GGUF in one format, served from its blocks alone (decode on the
    block kernel, the 20-token prefill on decoded panels): kvserve's logits equal
    transformers' reading the same file."""
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    shape, fmt = CASES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", shape, uniform(fmt), seed=len(case))
    engine = gguf_engine(path)
    model = engine.runner.model
    assert model.linear_backend == "gguf" and model.holds_blocks_only()
    assert all(set(layer.blocks) == {"qkv", "o_proj", "gate_up", "down"} for layer in model.layers)
    assert model.lm_head_blocks is not None and model.lm_head_blocks.format is fmt
    assert model.arch.attention_bias == (shape.arch == "qwen2")
    rec = LogitRecorder(engine)
    engine.generate([list(range(3, 23)), [7, 3, 60]], GREEDY)
    assert check_against_hf(hf_from_gguf(path), rec) == 12


def test_f16_matrices_the_kernel_cannot_cut_in_32s_stay_dense(cache_dir, tmp_path):
    """An F16 file of width 80: its matrices of 80 columns are loaded dense, ffn_down's (160)
    as blocks, and the mixed model still gives transformers' logits."""
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    shape = GGUFShape(hidden=80, layers=2, heads=4, kv_heads=2, ffn=160, vocab=512, context=256)
    path = write_gguf(tmp_path / "f16-width-80.gguf", shape, uniform(BlockFormat.F16))
    engine = gguf_engine(path)
    model = engine.runner.model
    assert model.holds_blocks_only() and model.lm_head_blocks is None
    assert all(set(layer.blocks) == {"down"} for layer in model.layers)
    rec = LogitRecorder(engine)
    engine.generate([list(range(3, 23)), [7, 3, 60]], GREEDY)
    assert check_against_hf(hf_from_gguf(path), rec) == 12


def test_mixed_q4_k_m_file_dense_and_blocks_agree(cache_dir, tmp_path):
    """A Q4_K_M-style file (Q4_K, Q6_K LM head and some attn_v/ffn_down): the dense-resident
    engine attaches blocks to every matrix, and both residencies give transformers' logits."""
    from bench.make_gguf import q4_k_m
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    path = write_gguf(tmp_path / "tiny-q4_k_m.gguf", GGUFShape(**{**TINY.__dict__, "layers": 3}), q4_k_m)
    hf = hf_from_gguf(path)
    for resident in ("dense", "blocks"):
        engine = gguf_engine(path, resident)
        model = engine.runner.model
        assert model.holds_blocks_only() == (resident == "blocks")
        assert {layer.blocks["down"].format for layer in model.layers} == {BlockFormat.Q4_K, BlockFormat.Q6_K}
        # q, k Q4_K and v Q6_K: one fused matrix in two groups, each on its own kernel
        assert {BlockFormat.Q4_K, BlockFormat.Q6_K} in [layer.blocks["qkv"].formats for layer in model.layers]
        rec = LogitRecorder(engine)
        engine.generate([list(range(3, 23))], GREEDY)
        assert check_against_hf(hf, rec) == 6


def test_block_only_mode_holds_no_dense_copy(cache_dir, tmp_path):
    """With weights_resident blocks no matrix has a dense tensor (the embedding included:
    lookups decode rows): what stays is the blocks (no more than the file's bytes), the norms
    and the RoPE tables."""
    path = write_gguf(tmp_path / "tiny-q4k.gguf", TINY, uniform(BlockFormat.Q4_K))
    model = gguf_engine(path, "blocks").runner.model
    held = model.weight_bytes()
    assert all(getattr(layer, n).numel() == 0 for layer in model.layers for n in layer.blocks)
    assert model.lm_head.numel() == 0 and model.embed.numel() == 0
    assert held["blocks"] <= path.stat().st_size
    small = (model.rope_cos.numel() * 3 + TINY.hidden * (2 * TINY.layers + 1)) * 4
    assert held["dense"] <= small
    dense = gguf_engine(path, "dense").runner.model.weight_bytes()
    assert dense["dense"] > held["dense"] + 6 * held["blocks"]  # the fp32 copies the blocks replace
    with pytest.raises(ValueError, match="needs dense weights"):
        model.select_linear_backend("onednn")
