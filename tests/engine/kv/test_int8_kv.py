"""int8 KV blocks on the tiny model: teacher-forced agreement with fp32 KV, capacity, the tier."""
from __future__ import annotations

import random

import pytest
import torch

from bench.probes.kv_int8 import compare, teacher_forced
from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def against_fp32_kv(hf_model, kv_cache_dtype: str) -> tuple[dict, torch.Tensor, torch.Tensor, object]:
    """240 random tokens teacher-forced (chunks of 16, so later chunks read the pool) with fp32 KV
    and with ``kv_cache_dtype``: (compare's result, fp32 log-probs, the other's, its engine)."""
    tokens = [random.Random(0).randrange(3, 128) for _ in range(240)]
    fp32 = teacher_forced(tiny_engine(hf_model, num_blocks=80), tokens, chunk=16)
    engine = tiny_engine(hf_model, num_blocks=80, kv_cache_dtype=kv_cache_dtype)
    other = teacher_forced(engine, tokens, chunk=16)
    return compare(fp32, other, tokens), fp32, other, engine


def test_int8_kv_agrees_with_fp32_teacher_forced(hf_model):
    result, fp32, int8, engine = against_fp32_kv(hf_model, "int8")
    assert result["top1_agreement"] >= 0.99, result
    assert abs(result["nll_delta"]) < 0.01, result
    assert (fp32 - int8).abs().max() > 0  # the int8 path really ran
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0


def test_int8_capacity_and_disk_tier_roundtrip(hf_model, tmp_path):
    fp32 = tiny_engine(hf_model)
    int8 = tiny_engine(hf_model, kv_cache_dtype="int8", kv_disk_dir=str(tmp_path), kv_disk_gib=0.01, num_blocks=24)
    # head_dim 16: (16 + 8) bytes instead of 64 per token, head and K/V.
    assert fp32.capacity.bytes_per_token / int8.capacity.bytes_per_token == pytest.approx(64 / 24)
    assert int8.runner.model.attn.name in ("native", "torch")  # native where the kernel builds
    p = [random.Random(1).randrange(3, 128) for _ in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = int8.generate([p], params)[0]
    int8.generate([[random.Random(2 + i).randrange(3, 128) for _ in range(60)] for i in range(4)],
                  SamplingParams(temperature=0.0, max_tokens=2))
    int8.offloader.tier.flush(10)
    again = int8.generate([p], params)[0]
    assert again.num_cached_tokens == 40 and again.token_ids == first.token_ids
    int8.kv_cache.check_invariants()
    assert int8.kv_cache.usage == 0
    int8.close()


def native_and_torch_decode(hf_model, kv_cache_dtype: str) -> tuple[dict[str, list], dict[str, str]]:
    """Batched greedy decode (logprobs on) over ragged prompts, block edges included, on the
    torch and the native attention backend with a ``kv_cache_dtype`` pool: each backend's
    outputs and decode path, after checking that it ran and left no block held."""
    require_native_kernel()
    prompts = [[random.Random(10 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((3, 4, 9, 17, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    results, paths = {}, {}
    for backend in ("torch", "native"):
        engine = tiny_engine(hf_model, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
        assert engine.runner.model.attn.name == backend
        paths[backend] = engine.runner.model.decode_path
        results[backend] = engine.generate(prompts, params)
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
    return results, paths


def test_int8_native_decode_equals_the_torch_int8_path(hf_model):
    """``--kv-cache-dtype int8`` on the native backend: batched greedy decode over ragged prompts
    (block edges included) gives the torch int8 reference's tokens and logprobs."""
    results, _ = native_and_torch_decode(hf_model, "int8")
    auto = tiny_engine(hf_model, kv_cache_dtype="int8")
    assert auto.runner.model.attn.name == "native"  # auto no longer falls back to torch for int8
    for ref, got in zip(results["torch"], results["native"]):
        assert got.token_ids == ref.token_ids
        assert len(got.logprobs) == 8
        for a, b in zip(ref.logprobs, got.logprobs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
