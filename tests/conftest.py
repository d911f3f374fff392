"""Session-wide fixtures. The real default model is loaded once and shared."""
from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined (at import): without a GPU the
# kernels run in its interpreter on CPU tensors (tests/engine/attention/test_triton_attention.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests share two cores with the rest of the machine; one intra-op thread keeps them predictable.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_engine():
    """LLMEngine on SmolLM2-135M-Instruct (converted once to the kvserve cache folder), with the
    exact flags: fp32 activations and a float32 KV pool (tests compare it token for token with
    transformers); these are what kvserve's CPU defaults (int8 activations, fp16 KV) are not."""
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig
    from tests.helpers import EXACT_CACHE_FLAGS, EXACT_MODEL_FLAGS

    config = EngineConfig(model=ModelConfig(num_threads=1, max_model_len=2048, **EXACT_MODEL_FLAGS),
                          cache=CacheConfig(kv_cache_memory_gib=0.25, **EXACT_CACHE_FLAGS),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32))
    return LLMEngine(config)


@pytest.fixture(scope="session")
def hf_default_model(default_engine):
    """transformers' own LlamaForCausalLM on the same dense weights: the oracle."""
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model_dir

    path, _ = resolve_model_dir(None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
