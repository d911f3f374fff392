"""The real default model (SmolLM2-135M-Instruct) through the paged engine versus transformers."""
from __future__ import annotations

import pytest
import torch

from kvtypes.sampling_params import SamplingParams
from engine.tokenizer import encode_chat

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def test_greedy_chat_completions_equal_transformers_generate(default_engine, hf_default_model):
    tok = default_engine.tokenizer
    prompts = [encode_chat(tok, chat) for chat in CHATS]
    ours = default_engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32))
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_default_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                            do_sample=False)[0, len(prompt):].tolist()
        assert result.token_ids == ref, (tok.decode(result.token_ids), tok.decode(ref))
    assert "Paris" in ours[0].text


def test_prefix_cache_runs_only_the_uncached_tail(default_engine):
    tok = default_engine.tokenizer
    words = "The quick brown fox jumps over the lazy dog while the river keeps flowing. "
    prompt = tok(words * 80)["input_ids"][:1000]
    assert len(prompt) == 1000
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    default_engine.kv_cache.reset_prefix_cache()
    before = default_engine.runner.num_tokens_computed
    first = default_engine.generate([prompt], params)[0]
    mid = default_engine.runner.num_tokens_computed
    second = default_engine.generate([prompt], params)[0]
    after = default_engine.runner.num_tokens_computed
    block = default_engine.capacity.block_size
    cached = (len(prompt) - 1) // block * block  # the last prompt token is always recomputed
    assert first.num_cached_tokens == 0 and mid - before == 1000 + 7
    assert second.num_cached_tokens == cached
    assert after - mid == (1000 - cached) + 7
    assert second.token_ids == first.token_ids
