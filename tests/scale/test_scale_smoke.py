"""Scale smoke: two kvserve replicas (1 thread each) behind the real sglang-router on loopback.

A tiny random Llama with SmolLM2's tokenizer keeps it quick: routing and prefix caching depend
on the tokens, not on the weights. See bench/scale.py for the workload and the failover step.
"""
from __future__ import annotations

import pytest
import torch

from bench.scale import SmokeConfig, smoke

pytestmark = pytest.mark.slow  # SmolLM2's tokenizer (the default model's conversion cache)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)[0]), local_files_only=True)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-smol")
    LlamaForCausalLM(config).eval().save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_cache_aware_routing_and_failover(tiny_checkpoint, tmp_path):
    lines: list[str] = []
    cfg = SmokeConfig(model=tiny_checkpoint, tenants=8, prompt_tokens=500, requests=64, max_tokens=2,
                      concurrency=2, max_model_len=1024, stream_tokens=800)
    ok, out = smoke(cfg, tmp_path, report=lines.append)
    print("\n".join(lines))
    ca, rr, fo = out["cache_aware"], out["round_robin"], out["failover"]
    assert ca["requests"] == rr["requests"] == 64 and ca["errors"] == rr["errors"] == 0, lines
    assert ca["prompt_tokens"] / 64 >= 450, "the tenants' prompts are about 500 tokens"
    assert sorted(ca["first_round_per_replica"]) == [4, 4], lines  # see bench/scale.py: placement retries
    assert ca["cached_fraction"] >= 0.8, lines
    assert rr["cached_fraction"] <= 0.5, lines
    # Failover: the streams on the killed replica error out (none hangs), the rest finish,
    # and every request after the kill is served by the surviving replica.
    assert fo["on_killed"] >= 1 and fo["hung"] == 0, lines
    assert fo["stream_errors"] == fo["on_killed"], lines
    assert fo["stream_completed"] == fo["streams"] - fo["on_killed"], lines
    assert fo["after_ok"] == 8 and fo["after_failed"] == 0, lines
    assert ok, lines
