"""Shared builders for tests: tiny random Llama models and engines around them."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache import CacheConfig
from engine.model.arch import ModelArch
from engine.config import ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from scheduler.config import SchedulerConfig

# The exact flags: fp32 activations and fp32 KV, so that a test may compare with transformers
# token for token or logprob for logprob (kvserve's CPU defaults, int8 activations on GGUF
# blocks and fp16 KV, round: tests/engine/model/test_default_numerics.py holds them).
EXACT_MODEL_FLAGS = {"activation_quant": "none"}
EXACT_CACHE_FLAGS = {"kv_cache_dtype": "float32"}


def tiny_llama_config(**overrides) -> LlamaConfig:
    params = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_hf_model(config: LlamaConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config or tiny_llama_config())
    # Random init is small; widen the weights so logits differ and greedy paths are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model.eval()


def tiny_engine(hf_model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 128,
                max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                enable_prefix_caching: bool = True, tokenizer=None, attention_backend: str = "auto",
                dtype: str = "float32", device: str = "cpu", cuda_graphs: bool = True,
                scheduling_policy: str = "fcfs", **cache_options) -> LLMEngine:
    """``cache_options`` go to CacheConfig (kv_disk_dir, kv_disk_gib, kv_pin_fraction, ...).

    Exact flags (the tests built here compare token for token with transformers): fp32
    activations and, under a float32 model, a float32 KV pool, unless ``kv_cache_dtype`` says
    otherwise; not the CPU defaults (fp16 KV), which round."""
    cache_options.setdefault("kv_cache_dtype", "float32" if dtype == "float32" else "auto")
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    loaded = LoadedModel(path=None, name="tiny-llama", hf_config=hf_model.config,
                         arch=ModelArch.from_hf_config(hf_model.config), state_dict=state, tokenizer=tokenizer)
    config = EngineConfig(
        model=ModelConfig(num_threads=1, attention_backend=attention_backend, dtype=dtype, device=device,
                          cuda_graphs=cuda_graphs, **EXACT_MODEL_FLAGS),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                          **cache_options),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  policy=scheduling_policy),
    )
    return LLMEngine(config, loaded)


def require_native_kernel() -> None:
    """Skip where no C++ compiler exists; where one does, the kernel must build and load."""
    import shutil

    import pytest

    from engine.kernels import load_kernels

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the native paged attention kernel cannot be built here")
    assert load_kernels(), "the native paged attention kernel failed to build (see the log)"


def wait_until(predicate, timeout: float = 30.0, what: str = "the condition") -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def serve_inprocess(engine: LLMEngine):
    """``engine`` served as ``kvserve serve`` would serve it (the composition root, thread mode),
    under uvicorn in a thread: a ``bench.server.Server`` (close it)."""
    from bench.server import start_inprocess
    from kvserve.compose import build_service
    from server.config import ServerConfig

    service = build_service(EngineConfig(), ServerConfig(log_stats_interval_s=0), engine=engine)
    return start_inprocess(service.app, service.engine.model_name)


def push_through(generate):
    """An ``EngineClient.push`` over ``generate``, for a test that wraps ``generate`` (a gate, a
    hold) to control when a request runs: the wrapped generator runs in a task that hands each
    output to the sink, so the wrapper holds the pushed streams (streamed chat and completions)
    too. Closing cancels the task, which closes the generator (and aborts an unfinished request)."""
    import asyncio

    def push(prompt_ids, params, sink, request_id=None, cache_salt=None, priority=0, tenant=None):
        async def pump() -> None:
            async for out in generate(prompt_ids, params, request_id, cache_salt, priority, tenant):
                sink(out)

        task = asyncio.ensure_future(pump())
        return lambda finished: task.cancel()
    return push
