"""Tensor parallelism on CUDA: ``device: cuda`` with ``tensor_parallel_size`` N runs NCCL, rank
``r`` on ``cuda:r``, and gives TP=1's greedy tokens (prefix caching and preemption in play).

The two-rank test needs 2 GPUs and is skipped with fewer; the refusal runs on one GPU.
"""
from __future__ import annotations

import random

import pytest
import torch

from cache import CacheConfig
from engine.model.arch import ModelArch
from engine.config import ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from tests.helpers import tiny_hf_model, tiny_llama_config

CONFIG = dict(vocab_size=131, num_attention_heads=4, num_key_value_heads=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def engine(hf, tp: int, attention_backend: str = "torch", kv_cache_dtype: str = "auto", **cache_options) -> LLMEngine:
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    loaded = LoadedModel(path=None, name="tiny-llama", hf_config=hf.config,
                         arch=ModelArch.from_hf_config(hf.config), state_dict=state, tokenizer=None)
    # float32 on the torch backend: only the summation order differs between TP=1 and TP=2.
    return LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=1, attention_backend=attention_backend, tensor_parallel_size=tp,
                          device="cuda", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=14, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype,
                          **cache_options),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)), loaded)


def workload() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 131) for _ in range(12)]
    return [shared + [rng.randrange(3, 131) for _ in range(rng.randint(2, 6))] for _ in range(4)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(tiny_llama_config(**CONFIG))


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_tp2_nccl_equals_tp1(hf):
    ps = workload()
    expected = engine(hf, 1).generate(ps, PARAMS)
    two = engine(hf, 2)
    model = two.runner.model
    try:
        assert model.ranks.group.backend == "nccl" and isinstance(model.ranks.group.pg, torch.distributed.ProcessGroupNCCL)
        assert model.ranks.device == torch.device("cuda", 0) and model.embed.device == torch.device("cuda", 0)
        assert two.runner.kv_caches[0][0].device.type == "cuda" and two.runner.kv_caches[0][0].shape[2] == 1
        assert two.runner.graphs is None  # no CUDA graphs with more than one rank
        got = two.generate(ps, PARAMS)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert two.scheduler.stats.num_preemptions > 0 and two.scheduler.stats.prefix_cache_hits > 0
        assert two.kv_cache.usage == 0
    finally:
        two.close()
    assert all(not p.is_alive() for p in model.ranks.procs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_tp2_int8_kv_on_triton_equals_tp1(hf):
    """Each rank holds int8 pools of its own heads and reads them in the Triton kernels."""
    from engine.kv.int8 import Int8KV

    ps = workload()
    expected = engine(hf, 1, "triton", "int8").generate(ps, PARAMS)
    two = engine(hf, 2, "triton", "int8")
    try:
        assert isinstance(two.runner.kv_caches[0][0], Int8KV) and two.runner.model.attn.name == "triton"
        got = two.generate(ps, PARAMS)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert two.kv_cache.usage == 0
    finally:
        two.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs 2 GPUs")
def test_tp2_disk_and_host_tiers_on_cuda(hf, tmp_path):
    """Tier copies gather both GPUs' KV heads (over the gloo group) and scatter them back: a TP=2
    engine restarted on a TP=1 engine's disk folder serves the prefix with TP=1's tokens."""
    p = [random.Random(5).randrange(3, 131) for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seed = engine(hf, 1, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    seed.generate([p], params)
    reference = seed.generate([p], params)[0]
    seed.close()
    two = engine(hf, 2, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01, kv_offload_gib=0.01)
    try:
        got = two.generate([p], params)[0]
        assert got.num_cached_tokens == 28 and got.token_ids == reference.token_ids
        assert two.scheduler.stats.tier_hits["disk"] == 28
        assert two.kv_cache.usage == 0
    finally:
        two.close()


def test_more_ranks_than_gpus_is_refused(hf):
    n = torch.cuda.device_count() + 1
    hf_n = tiny_hf_model(tiny_llama_config(vocab_size=131, num_attention_heads=4 * n, num_key_value_heads=n,
                                           hidden_size=64 * n, head_dim=16, intermediate_size=128 * n))
    with pytest.raises(ValueError, match=f"tensor_parallel_size {n} needs {n} GPUs"):
        engine(hf_n, n)
