"""The paged engine's logits equal transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import random

import pytest
import torch

from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model, tiny_llama_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ATOL = 2e-4


class LogitRecorder:
    """Wraps the engine's sampler to keep each row's logits, keyed by request and position."""

    def __init__(self, engine) -> None:
        self.inner = engine.runner.sampler
        self.records: dict[tuple[int, ...], torch.Tensor] = {}
        engine.runner.sampler = self

    def __call__(self, logits, rows):
        for i, row in enumerate(rows):
            key = tuple(row.prompt_token_ids) + tuple(row.output_token_ids)
            self.records[key] = logits[i].clone()
        return self.inner(logits, rows)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]


def check_against_hf(hf_model, recorder: LogitRecorder) -> int:
    checked = 0
    for seq, logits in recorder.records.items():
        expected = hf_logits(hf_model, list(seq))[-1]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
        checked += 1
    return checked


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128) for _ in range(n)]


CONFIGS = {
    "gqa": tiny_llama_config(),
    "mha-tied": tiny_llama_config(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": tiny_llama_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mqa": tiny_llama_config(num_key_value_heads=1),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def hf_model(request):
    return tiny_hf_model(CONFIGS[request.param])


@pytest.fixture(params=["torch", "native"])
def backend(request):
    """Every test runs on both attention backends (native: the compiled paged decode kernel)."""
    if request.param == "native":
        require_native_kernel()
    return request.param


def test_prefill_and_decode_match(hf_model, backend):
    engine = tiny_engine(hf_model, attention_backend=backend)
    rec = LogitRecorder(engine)
    rng = random.Random(0)
    engine.generate([random_prompt(rng, 13)], GREEDY)
    assert check_against_hf(hf_model, rec) == 6  # one prefill sample + five decode samples


def test_batched_mixed_lengths_match(hf_model, backend):
    engine = tiny_engine(hf_model, attention_backend=backend)
    rec = LogitRecorder(engine)
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (1, 5, 17, 30, 3)]
    results = engine.generate(prompts, GREEDY)
    assert all(len(r.token_ids) == 6 for r in results)
    assert check_against_hf(hf_model, rec) == 30


def test_chunked_prefill_matches(hf_model, backend):
    # A budget of 8 tokens forces a 37-token prompt through five chunks with a cached context.
    engine = tiny_engine(hf_model, max_num_batched_tokens=8, attention_backend=backend)
    rec = LogitRecorder(engine)
    rng = random.Random(2)
    prompt = random_prompt(rng, 37)
    steps_before = engine.runner.num_tokens_computed
    engine.generate([prompt], GREEDY)
    assert engine.runner.num_tokens_computed - steps_before == 37 + 5
    assert check_against_hf(hf_model, rec) == 6


def test_prefix_cache_hit_matches(hf_model, backend):
    engine = tiny_engine(hf_model, block_size=4, attention_backend=backend)
    rec = LogitRecorder(engine)
    rng = random.Random(3)
    shared = random_prompt(rng, 12)
    first = engine.generate([shared + random_prompt(rng, 3)], GREEDY)[0]
    computed = engine.runner.num_tokens_computed
    second = engine.generate([shared + random_prompt(rng, 5)], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12  # three full blocks of the shared prefix
    assert engine.runner.num_tokens_computed - computed == (17 - 12) + 5
    assert check_against_hf(hf_model, rec) == 12


def test_greedy_tokens_equal_hf_generate(hf_model, backend):
    engine = tiny_engine(hf_model, attention_backend=backend)
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (4, 9, 21)]
    ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                    min_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.token_ids == ref
