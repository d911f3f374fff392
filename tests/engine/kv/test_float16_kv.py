"""fp16 KV blocks under a float32 model (``--kv-cache-dtype float16``, llama.cpp's default KV
type): the pool, its capacity, agreement with fp32 KV, the native path against the torch one,
prefix reuse from the pool and from the disk tier, and where it is refused."""
from __future__ import annotations

import random

import pytest
import torch

from cache.config import CacheConfig
from engine.model.arch import ModelArch
from engine.attention.base import resolve_backend
from engine.config import ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from kvtypes.sampling_params import SamplingParams
from tests.engine.kv.test_int8_kv import against_fp32_kv, native_and_torch_decode
from tests.helpers import tiny_engine, tiny_hf_model


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def test_float16_pool_holds_twice_the_tokens(hf_model):
    fp32 = tiny_engine(hf_model, num_blocks=None, kv_cache_memory_gib=0.001)
    fp16 = tiny_engine(hf_model, num_blocks=None, kv_cache_memory_gib=0.001, kv_cache_dtype="float16")
    assert fp16.runner.kv_caches[0][0].dtype == torch.float16 and fp16.runner.kv_caches[0][1].dtype == torch.float16
    assert fp32.capacity.bytes_per_token == 2 * fp16.capacity.bytes_per_token
    assert fp16.capacity.num_blocks == 2 * fp32.capacity.num_blocks
    assert fp16.info.kv_cache_dtype == "float16"


def test_float16_kv_agrees_with_fp32_teacher_forced(hf_model):
    result, fp32, fp16, engine = against_fp32_kv(hf_model, "float16")
    assert result["top1_agreement"] >= 0.995, result
    assert abs(result["nll_delta"]) < 1e-3, result
    assert (fp32 - fp16).abs().max() > 0  # the fp16 pool really rounded
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0


def test_float16_native_decode_equals_the_torch_float16_path(hf_model):
    """Batched greedy decode over ragged prompts (block edges included): the native kernels
    (DecodeStack, F16C reads) give the torch backend's tokens and logprobs on fp16 pools."""
    results, paths = native_and_torch_decode(hf_model, "float16")
    assert paths == {"torch": "python", "native": "native"}
    for ref, got in zip(results["torch"], results["native"]):
        assert got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_prefix_hits_from_the_pool_and_the_disk_tier_give_the_same_tokens(hf_model, tmp_path):
    """A fresh prompt attends to its own K/V rounded as the pool holds them, so reusing its blocks
    (from the pool, then from the disk tier after eviction) changes nothing."""
    engine = tiny_engine(hf_model, kv_cache_dtype="float16", kv_disk_dir=str(tmp_path), kv_disk_gib=0.01,
                         num_blocks=24)
    p = [random.Random(1).randrange(3, 128) for _ in range(41)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    first = engine.generate([p], params)[0]
    cached = engine.generate([p], params)[0]
    assert cached.num_cached_tokens == 40 and cached.token_ids == first.token_ids
    engine.generate([[random.Random(2 + i).randrange(3, 128) for _ in range(60)] for i in range(4)],
                    SamplingParams(temperature=0.0, max_tokens=2))
    engine.offloader.tier.flush(10)
    from_disk = engine.generate([p], params)[0]
    assert from_disk.num_cached_tokens == 40 and from_disk.token_ids == first.token_ids
    for a, b in zip(first.logprobs, from_disk.logprobs):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0
    engine.close()


def test_float16_under_a_float16_model_is_the_models_own_dtype(hf_model):
    engine = tiny_engine(hf_model, dtype="float16", kv_cache_dtype="float16", num_blocks=16)
    assert engine.info.kv_cache_dtype == "auto" and engine.runner.kv_caches[0][0].dtype == torch.float16


def test_where_float16_kv_is_refused(hf_model, monkeypatch):
    """The GPU kernels read pools of the model's dtype only: ``auto`` passes over them to torch,
    naming one says why; tensor parallel ranks and unknown names are refused."""
    from engine.attention.base import BACKENDS

    for name in ("flash_attn", "triton"):  # as if this host had CUDA, flash-attn and Triton
        monkeypatch.setattr(BACKENDS[name], "unavailable", classmethod(lambda cls, *a: None))
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.bfloat16, 256) == "flash_attn"
    assert resolve_backend("auto", cuda, torch.bfloat16, 256, kv_cache_dtype="float16") == "torch"
    with pytest.raises(ValueError, match="'triton' cannot run on cuda in bfloat16 with block_size 16 with a float16 "
                                         "KV pool: its kernels do not read float16 KV pools; kv_cache_dtype float16 "
                                         "runs on torch, native"):
        resolve_backend("triton", cuda, torch.bfloat16, 16, kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, float16, float32, int4, got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")
    config = EngineConfig(model=ModelConfig(tensor_parallel_size=2, num_threads=1),
                          cache=CacheConfig(kv_cache_dtype="float16", num_blocks=8))
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    loaded = LoadedModel(path=None, name="tiny-llama", hf_config=hf_model.config,
                         arch=ModelArch.from_hf_config(hf_model.config), state_dict=state, tokenizer=None)
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' .* tensor_parallel_size > 1"):
        LLMEngine(config, loaded)
