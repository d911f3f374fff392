"""Linear layers from GGUF blocks: the kernel against gguf's own dequantization and F.linear,
the q/k row order against transformers' GGUF reader, and the default model's blocks."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.loader.gguf.blocks import BlockFormat, GGUFMatrix

from engine.model.block_linear import BlockLinear

from engine.loader.gguf.names import hf_name, unpermute_rows
from tests.helpers import require_native_kernel

GGML = {BlockFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1, BlockFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def random_blocks(fmt: BlockFormat, rows: int, cols: int, seed: int = 0) -> tuple[GGUFMatrix, np.ndarray]:
    """Blocks quantized by gguf itself from random weights, and their uint8 array."""
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(weights, GGML[fmt])
    return GGUFMatrix(torch.from_numpy(raw.copy()), fmt, cols), raw


def reference(raw: np.ndarray, fmt: BlockFormat, rows: int, cols: int) -> torch.Tensor:
    """gguf's own dequantization: the values a dense checkpoint converted from the file holds."""
    return torch.from_numpy(gguf.quants.dequantize(raw, GGML[fmt]).reshape(rows, cols))


@pytest.mark.parametrize("fmt", list(GGML))  # the formats gguf-py quantizes; all formats: test_gguf_formats.py
@pytest.mark.parametrize("rows", [37, 64])  # 37: the last strip of 8 columns is partial
def test_packed_weights_are_ggufs_values_bit_for_bit(fmt, rows):
    blocks, raw = random_blocks(fmt, rows, 96)
    packed = blocks.pack()
    assert packed.data.shape == ((rows + 7) // 8, 3 * (160 if fmt is BlockFormat.Q4_1 else 272))
    assert torch.equal(packed.dequantize(), reference(raw, fmt, rows, 96))


@pytest.mark.parametrize("fmt", list(GGML))  # the formats gguf-py quantizes; all formats: test_gguf_formats.py
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33])  # every row-group size, and remainders
@pytest.mark.parametrize("out_features", [37, 64])
def test_kernel_equals_f_linear_on_the_dequantized_matrix(fmt, rows, out_features):
    blocks, raw = random_blocks(fmt, out_features, 160, seed=rows)
    packed = blocks.pack()
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.kvserve.gguf_linear(x, packed.data, out_features, int(fmt))
    want = F.linear(x, reference(raw, fmt, out_features, 160))
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # summation order only


def test_strided_input_and_empty_batch():
    blocks, raw = random_blocks(BlockFormat.Q4_1, 8, 64)
    packed = blocks.pack()
    x = torch.randn(64, 3).t()  # not contiguous
    torch.testing.assert_close(torch.ops.kvserve.gguf_linear(x, packed.data, 8, 0),
                               F.linear(x, reference(raw, BlockFormat.Q4_1, 8, 64)), rtol=1e-5, atol=1e-5)
    assert torch.ops.kvserve.gguf_linear(torch.empty(0, 64), packed.data, 8, 0).shape == (0, 8)


def test_bad_input_is_a_clear_error():
    blocks, _ = random_blocks(BlockFormat.Q8_0, 4, 64)
    packed = blocks.pack()
    with pytest.raises(RuntimeError, match="do not hold 4 x 96 weights"):
        torch.ops.kvserve.gguf_linear(torch.randn(2, 96), packed.data, 4, 1)
    with pytest.raises(RuntimeError, match="do not hold 9 x 64 weights"):
        torch.ops.kvserve.gguf_linear(torch.randn(2, 64), packed.data, 9, 1)
    with pytest.raises(RuntimeError, match="format must be"):
        torch.ops.kvserve.gguf_linear(torch.randn(2, 64), packed.data, 4, len(BlockFormat))  # one past the last
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kvserve.gguf_linear(torch.randn(2, 64, dtype=torch.float64), packed.data, 4, 1)
    with pytest.raises(RuntimeError, match="K / 32 blocks"):
        torch.ops.kvserve.gguf_pack(blocks.data, 96, 1)
    with pytest.raises(ValueError, match="not Q4_1 rows of 64"):
        GGUFMatrix(blocks.data, BlockFormat.Q4_1, 64)


@pytest.mark.parametrize("fmt", list(GGML))  # the formats gguf-py quantizes; all formats: test_gguf_formats.py
def test_block_linear_sends_large_calls_to_the_dense_path(fmt):
    blocks, raw = random_blocks(fmt, 16, 64)
    weight, bias = reference(raw, fmt, 16, 64), torch.randn(16)
    dense_calls = []

    def dense(x):
        dense_calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    linear = BlockLinear(blocks.pack(), bias, dense)
    limit = BlockLinear.MAX_ROWS[fmt]
    small, large = torch.randn(limit, 64), torch.randn(limit + 1, 64)
    torch.testing.assert_close(linear(small), F.linear(small, weight, bias), rtol=1e-5, atol=1e-5)
    assert dense_calls == []
    linear(large)
    assert dense_calls == [limit + 1]


def test_stack_needs_every_part_in_one_format():
    a, _ = random_blocks(BlockFormat.Q4_1, 3, 64)
    b, _ = random_blocks(BlockFormat.Q4_1, 5, 64, seed=1)
    c, _ = random_blocks(BlockFormat.Q8_0, 5, 64)
    stacked = GGUFMatrix.stack([a, b])
    assert stacked is not None
    assert torch.equal(stacked.pack().dequantize(), torch.cat([a.pack().dequantize(), b.pack().dequantize()]))
    assert GGUFMatrix.stack([a, c]) is None and GGUFMatrix.stack([a, None]) is None


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_row_order_matches_transformers_gguf_reader(heads, kv_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    head_dim = 8
    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for name, n_heads in (("blk.0.attn_q.weight", heads), ("blk.0.attn_k.weight", kv_heads)):
        stored = np.random.default_rng(n_heads).standard_normal((n_heads * head_dim, 4)).astype(np.float32)
        expected = processor.process(stored, name).weights
        np.testing.assert_array_equal(stored[unpermute_rows(stored.shape[0], n_heads)], expected)


def test_tensor_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.slow
def test_default_model_runs_its_decode_matmuls_from_blocks(default_engine):
    """Every matmul of the default model has blocks that decode to its dense weights exactly
    (attach_blocks checks that, so a wrong row order or format would leave gaps here)."""
    model = default_engine.runner.model
    assert model.linear_backend == "gguf"
    assert all(set(layer.blocks) == {"qkv", "o_proj", "gate_up", "down"} for layer in model.layers)
    assert model.lm_head_blocks is not None and model.lm_head_blocks.format is BlockFormat.Q8_0
    assert isinstance(model.lm_head_mm, BlockLinear)
    dense_bytes = sum(p.numel() * 4 for p in model.layers.parameters()) + model.lm_head.numel() * 4
    assert model.decode_weight_bytes() < dense_bytes / 4


def quantize_in_place(hf_model, tied: bool) -> dict[str, GGUFMatrix]:
    """Make a tiny HF model's matrices exactly GGUF-representable, as a GGUF checkpoint's are
    (layers Q4_1, LM head Q8_0); return the blocks under transformers' names."""
    blocks = {}
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("_proj.weight") or name == head:
                fmt = BlockFormat.Q8_0 if name == head else BlockFormat.Q4_1
                raw = gguf.quants.quantize(p.numpy(), GGML[fmt])
                blocks[name] = GGUFMatrix(torch.from_numpy(raw), fmt, p.shape[1])
                p.copy_(reference(raw, fmt, *p.shape))
    return blocks


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_model_on_blocks_matches_transformers(tied):
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    hf_model = tiny_hf_model(tiny_llama_config(tie_word_embeddings=tied))
    blocks = quantize_in_place(hf_model, tied)
    engine = tiny_engine(hf_model)
    model = engine.runner.model
    assert model.attach_blocks(blocks) == 4 * len(model.layers) + 1
    assert model.select_linear_backend("gguf") == "gguf"
    rec = LogitRecorder(engine)
    engine.generate([[5, 9, 17, 33, 4, 8, 90], [7, 3, 60]], GREEDY)  # decode runs 2 rows: the block kernel
    assert check_against_hf(hf_model, rec) == 12


def test_blocks_that_do_not_decode_to_the_weights_are_not_used(caplog):
    from tests.helpers import tiny_engine, tiny_hf_model

    hf_model = tiny_hf_model()
    blocks = quantize_in_place(hf_model, tied=False)
    blocks["model.layers.1.mlp.up_proj.weight"], _ = random_blocks(BlockFormat.Q4_1, 128, 64)
    model = tiny_engine(hf_model).runner.model
    assert model.attach_blocks(blocks) == 4 * len(model.layers)  # layer 1's gate_up runs dense
    assert "gate_up" not in model.layers[1].blocks and "gate_up" in model.layers[0].blocks
    assert "do not decode to the loaded weights" in caplog.text


def test_gguf_backend_without_blocks_is_a_clear_error():
    from tests.helpers import tiny_engine, tiny_hf_model

    model = tiny_engine(tiny_hf_model()).runner.model
    assert model.linear_backend in ("onednn", "aten")  # auto: no GGUF behind a tiny model
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        model.select_linear_backend("gguf")


def test_portable_path_equals_f_linear():
    """The loop non-AVX2 CPUs run (forced here by KVSERVE_PORTABLE_KERNELS, read once per process)."""
    script = """
import gguf, numpy as np, torch, torch.nn.functional as F
from engine.kernels import load_kernels
assert load_kernels() and torch.ops.kvserve.gguf_kernel_isa() == "portable"
for fmt, kind in ((0, gguf.GGMLQuantizationType.Q4_1), (1, gguf.GGMLQuantizationType.Q8_0)):
    raw = gguf.quants.quantize(np.random.default_rng(fmt).standard_normal((37, 96)).astype(np.float32), kind)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(37, 96))
    packed = torch.ops.kvserve.gguf_pack(torch.from_numpy(raw), 96, fmt)
    for rows in (1, 9):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(torch.ops.kvserve.gguf_linear(x, packed, 37, fmt), F.linear(x, dense),
                                   rtol=1e-5, atol=1e-5)
print("ok")
"""
    env = {**os.environ, "KVSERVE_PORTABLE_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.slow
def test_the_default_models_blocks(default_engine):
    """Every matrix of the shipped SmolLM2 Q4_1 is read as blocks: q k v o gate up down per layer
    and the (tied) embedding, which is Q8_0."""
    from engine.loader import default_gguf_path
    from engine.loader.gguf.tensors import read_gguf_blocks

    blocks = read_gguf_blocks(default_gguf_path(), default_engine.arch)
    assert len(blocks) == 7 * default_engine.arch.num_layers + 1
    assert blocks["model.embed_tokens.weight"].format is BlockFormat.Q8_0
