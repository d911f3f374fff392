"""The bf16 model path (the GPU default) on CPU against transformers in bf16.

Both sides compute in bfloat16 with different fusions (kvserve fuses q/k/v and gate/up),
so logits agree to a few bf16 ulps at their magnitude (~2: an ulp is 1/64) and greedy
tokens agree. Llama (GQA, MQA, MHA with tied embeddings), Qwen2 (q/k/v biases) and
Mistral shapes, loaded from a safetensors directory the way a checkpoint is.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, hf_logits

BF16_ATOL = 0.06  # ~4 bf16 ulps at |logit| ~ 2

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def widen(model):
    """Random weights (and biases) wide enough that logits differ; norms stay at one."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.08)
    return model.eval()


MODELS = {
    "llama-gqa": lambda: tiny_hf_model(tiny_llama_config()),
    "llama-mqa": lambda: tiny_hf_model(tiny_llama_config(num_key_value_heads=1)),
    "llama-mha-tied": lambda: tiny_hf_model(tiny_llama_config(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-bias": lambda: widen(Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True))),
    "mistral": lambda: widen(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None))),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_logits_match_transformers(name, tmp_path):
    hf = MODELS[name]()
    hf.save_pretrained(tmp_path)  # safetensors; reload as a checkpoint would be
    from safetensors.torch import load_file

    state = load_file(str(next(tmp_path.glob("*.safetensors"))))
    engine = tiny_engine(hf, dtype="bfloat16", attention_backend="torch", max_num_batched_tokens=16)
    engine.runner.model.load_hf_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    engine.runner.model.select_linear_backend("auto")
    assert engine.runner.model.embed.dtype == torch.bfloat16 and engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    recorder = LogitRecorder(engine)
    rng = random.Random(0)
    # 5: fresh prompt; 30 with a 16-token budget: chunked prefill over cached blocks
    engine.generate([[rng.randrange(3, 128) for _ in range(n)] for n in (5, 30)], GREEDY)
    hf_bf16 = hf.to(torch.bfloat16)
    agree = 0
    for seq, logits in recorder.records.items():
        expected = hf_logits(hf_bf16, list(seq))[-1].float()
        torch.testing.assert_close(logits, expected, atol=BF16_ATOL, rtol=0.02)
        agree += int(logits.argmax() == expected.argmax())
    assert len(recorder.records) == 12 and agree >= 11  # a near-tie may flip one greedy pick


@pytest.mark.slow
def test_gguf_is_dequantized_to_bf16_at_load():
    """The default model is a Q4_1 GGUF: in bf16 every weight is its float32 dequantization
    rounded to bf16 (the dequantized dense copy is cached, so both loads are quick)."""
    from engine.loader import load_model

    dense = load_model(None, torch.float32).state_dict
    bf16 = load_model(None, torch.bfloat16).state_dict
    assert bf16.keys() == dense.keys()
    for name, weight in bf16.items():
        assert weight.dtype == torch.bfloat16, name
        assert weight.equal(dense[name].to(torch.bfloat16)), name
