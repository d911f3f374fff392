"""Continuous batching on the real engine (tiny random Llama): batching never changes greedy output."""
from __future__ import annotations

import random

import pytest

from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def alone(hf_model, prompt, params=GREEDY) -> list[int]:
    return tiny_engine(hf_model).generate([prompt], params)[0].token_ids


def test_32_concurrent_requests_equal_each_run_alone(hf_model):
    ps = prompts(32, seed=0)
    engine = tiny_engine(hf_model, num_blocks=512, max_num_batched_tokens=64, max_num_seqs=32)
    together = engine.generate(ps, GREEDY)
    assert [r.token_ids for r in together] == [alone(hf_model, p) for p in ps]
    assert engine.kv_cache.usage == 0


def test_preempted_request_resumes_with_identical_tokens(hf_model):
    ps = prompts(3, seed=1, lo=10, hi=10)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    # 12 blocks of 4 tokens cannot hold three 24-token sequences: someone is preempted.
    engine = tiny_engine(hf_model, num_blocks=12, block_size=4, max_num_batched_tokens=64)
    results = engine.generate(ps, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [r.token_ids for r in results] == [alone(hf_model, p, params) for p in ps]
    assert engine.kv_cache.usage == 0


def test_seeded_sampling_is_independent_of_batch(hf_model):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    ps = prompts(6, seed=2)
    engine = tiny_engine(hf_model)
    together = engine.generate(ps, params)
    assert [r.token_ids for r in together] == [alone(hf_model, p, params) for p in ps]
