"""Decode rows split into length groups (one batched SDPA call per group) still match transformers."""
from __future__ import annotations

import random

from engine.model.runner import split_by_length
from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
from tests.engine.model.test_model_vs_transformers import LogitRecorder, check_against_hf, random_prompt


def test_split_by_length_partitions_in_order():
    assert split_by_length([], 256) == []
    assert split_by_length([7], 256) == [(0, 1)]
    assert split_by_length([9, 9, 9], 0) == [(0, 3)]
    assert split_by_length([10, 20, 30], 256) == [(0, 3)]  # padding is cheaper than another call
    assert split_by_length([50, 60, 900, 1000], 256) == [(0, 2), (2, 4)]
    groups = split_by_length(list(range(1, 200, 3)), 0)  # free calls: every distinct length alone
    assert groups == [(i, i + 1) for i in range(len(groups))]


def test_grouped_decode_matches_hf():
    hf = tiny_hf_model(tiny_llama_config())
    engine = tiny_engine(hf, num_blocks=256, attention_backend="torch")  # grouping is the torch path's
    engine.runner.group_cost_tokens = 0  # force one group per distinct context length
    rec = LogitRecorder(engine)
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (2, 40, 9, 23, 9, 61)]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert all(len(r.token_ids) == 5 for r in results)
    assert check_against_hf(hf, rec) == 30
