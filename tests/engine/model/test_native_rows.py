"""The layer's row ops (RMSNorm, the residual add before the second norm, RoPE) bound to the
native kernels (``native_rows``, engine/kernels/cpu/prefill_rows.cpp) or to torch's composites:
both prefill to transformers' logits, with GQA, a qkv bias, a cached prefix and several chunks
(the kernels alone: tests/engine/kernels/test_prefill_rows_kernel.py)."""
from __future__ import annotations

import pytest
import torch

from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model, tiny_llama_config


@pytest.mark.parametrize("native", [True, False])
def test_both_bindings_prefill_to_transformers_logits(native):
    require_native_kernel()
    hf = tiny_hf_model(tiny_llama_config(
        hidden_size=96, attention_bias=True, num_attention_heads=6, num_key_value_heads=2), seed=5)
    engine = tiny_engine(hf, max_num_batched_tokens=16)  # 40-token prompts: three chunks
    model = engine.runner.model
    assert model.native_rows and all(layer.native_rows for layer in model.layers)  # CPU, fp32, kernels built
    model.use_native_rows(native)
    seen: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda h: seen.append(compute(h).clone()) or seen[-1]
    prompt = [(5 * i + 3) % 120 + 3 for i in range(40)]
    second = prompt[:24] + [(7 * i) % 120 + 3 for i in range(16)]  # a 24-token cached prefix (block size 4)
    cached = [engine.generate([p], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens
              for p in (prompt, second)]
    assert cached == [0, 24]
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0, -1] for p in (prompt, second)]
    assert len(seen) == 2  # logits once per prompt, at its last chunk
    for got, ref in zip(seen, want):
        torch.testing.assert_close(got[-1], ref, rtol=1e-4, atol=1e-4)
