"""``prefill_matmul_dtype``: which calls ``BlockLinear`` sends to the bf16 kernel, and a Q4_K_M
model's bf16 prefill against its float32 one (the kernel itself:
tests/engine/kernels/test_prefill_linear_kernel.py; how ``auto`` resolves:
tests/engine/test_prefill_dtype.py)."""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.loader.gguf.blocks import BlockFormat
from engine.model.block_linear import BlockLinear
from tests.engine.loader.test_gguf_formats import blocks_and_reference
from tests.helpers import require_native_kernel



def bf16_kernel() -> None:
    require_native_kernel()
    if not torch.ops.kvserve.gguf_linear_bf16_supported():
        pytest.skip("the bf16 prefill kernel needs AMX-BF16 and AVX512-BF16 (Sapphire Rapids or later)")


@pytest.mark.parametrize("fmt", [BlockFormat.Q4_K, BlockFormat.Q6_K, BlockFormat.Q4_1, BlockFormat.Q5_0, BlockFormat.Q8_0,
                                 BlockFormat.F16])
def test_block_linear_takes_the_bf16_kernel_from_its_formats_row_count(fmt):
    """From BF16_MIN_ROWS[format] rows (32 for Q4_K / Q6_K, 128 for Q4_1 / Q5_K / Q5_0 / Q8_0) a matrix
    returns gguf_linear_bf16's bits (bias added), below it the decode kernel's; a format not listed
    (F16) never; with the flag off, none."""
    bf16_kernel()
    blocks, _ = blocks_and_reference(fmt, 48, 512, seed=1)
    bias = torch.randn(48)
    mm = BlockLinear(blocks.pack(), bias, None, int8_activations=True)
    data, n, f = mm.parts[0]

    def decode_path(x: torch.Tensor) -> torch.Tensor:  # without a dense copy: the kernel, or F16's panels
        if x.shape[0] <= mm.max_rows:
            return mm.kernels[0](x, data, n, f)
        return torch.ops.kvserve.gguf_linear_panels(x, data, n, f, mm.tile_rows)

    mm.use_bf16_prefill(True)
    assert mm.bf16_prefill == (fmt in BlockLinear.BF16_MIN_ROWS)
    first = BlockLinear.BF16_MIN_ROWS.get(fmt, 400)
    for rows in (first - 1, first):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        on_bf16 = mm.bf16_prefill and rows >= first
        want = torch.ops.kvserve.gguf_linear_bf16(x, data, n, f) if on_bf16 else decode_path(x)
        assert torch.equal(mm(x), want + bias), (fmt, rows)
    mm.use_bf16_prefill(False)
    assert not mm.bf16_prefill
    x = torch.randn(first, 512)
    assert torch.equal(mm(x), decode_path(x) + bias)


def test_a_matrix_in_two_formats_fills_one_output_on_the_bf16_kernel():
    """q / k in Q4_K and v in Q6_K, as Q4_K_M files store qkv: each part's gguf_linear_bf16 bits in
    its own columns, bias added."""
    bf16_kernel()
    from engine.loader.gguf.blocks import BlockMatrix
    qk, _ = blocks_and_reference(BlockFormat.Q4_K, 48, 512, seed=5)
    v, _ = blocks_and_reference(BlockFormat.Q6_K, 16, 512, seed=6)
    bias = torch.randn(64)
    mm = BlockLinear(BlockMatrix([qk.pack(), v.pack()]), bias, None, int8_activations=True)
    mm.use_bf16_prefill(True)
    x = torch.randn(mm.bf16_min_rows, 512, generator=torch.Generator().manual_seed(5))
    want = torch.cat([torch.ops.kvserve.gguf_linear_bf16(x, d, n, f) for d, n, f in mm.parts], dim=1) + bias
    assert len(mm.parts) == 2 and torch.equal(mm(x), want)


def test_a_q4_k_m_prefill_in_bf16_tracks_the_exact_flags(tmp_path, monkeypatch):
    """A Q4_K_M file (Q4_K, Q6_K) prefilling 150 tokens in one chunk, at the defaults with
    ``prefill_matmul_dtype`` float32 (int8 activations) and bfloat16, against the exact flags: with
    ``bfloat16`` every block matrix of the layers takes the bf16 kernel (the startup description
    says so), and the first logits stay as close to the exact ones as int8's: within 5% of the
    largest logit, the int8 tests' bound (bf16 rounds x and the weights at 2^-9 relative; random
    weights through 2 layers of 7 matmuls). They differ from float32's: another kernel ran."""
    bf16_kernel()
    from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
    from cache import CacheConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvtypes.sampling_params import SamplingParams
    from scheduler.config import SchedulerConfig
    from tests.helpers import EXACT_CACHE_FLAGS, EXACT_MODEL_FLAGS

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shape = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)
    path = write_gguf(tmp_path / "tiny-q4_k_m.gguf", shape, q4_k_m, seed=4)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(150)]
    runs = {"exact": ({**EXACT_MODEL_FLAGS, "prefill_attention_dtype": "float32"}, EXACT_CACHE_FLAGS),
            "float32": ({"prefill_matmul_dtype": "float32"}, {}), "bfloat16": ({"prefill_matmul_dtype": "bfloat16"}, {})}
    first = {}
    for name, (model_flags, cache_flags) in runs.items():
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(path), num_threads=1, **model_flags),
            cache=CacheConfig(block_size=16, num_blocks=32, **cache_flags),
            scheduler=SchedulerConfig(max_num_batched_tokens=256)))
        model = engine.runner.model
        layers = [mm for mm in model.block_linears() if mm is not model.lm_head_mm]
        assert all(mm.bf16_prefill == (name == "bfloat16") for mm in layers)
        if name == "bfloat16":
            assert engine.config.model.prefill_matmul_dtype == "bfloat16"
            assert model.describe_prefill_matmuls() == (f"bfloat16 on AMX tiles for {len(layers) + 1} of "
                                                        f"{len(layers) + 1} block matrices (Q4_K, Q6_K from 32 rows)")
        seen = []
        compute = model.compute_logits
        model.compute_logits = lambda h, f=compute: seen.append(f(h).clone()) or seen[-1]
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        first[name] = seen[0]
    ref, scale = first["exact"], first["exact"].abs().max().item()
    diffs = {name: (first[name] - ref).abs().max().item() for name in ("float32", "bfloat16")}
    print(f"max |diff| from exact: {diffs} of {scale:.2f}")
    assert diffs["bfloat16"] <= 0.05 * scale
    assert not torch.equal(first["bfloat16"], first["float32"])
