"""int4 KV pools (KIVI, engine/kv/int4.py) in the Triton paged kernels, in Triton's interpreter on CPU.

The oracle is the numpy reference of the format in tests/engine/kv/test_int4_kv.py (nibbles
unpacked one by one, open blocks from the residual), float64 attention over it. Pools are
written through the real plan + write path, so quantized blocks, blocks completed from the
residual and open (partial) blocks all occur. Covered: GQA and MHA, several head dims (24:
not a power of two, padded lanes) and block sizes, ragged lengths at block edges, split-K,
prefill chunks over cached prefixes (causal), and the engine on ``--attention-backend triton
--kv-cache-dtype int4`` against the torch int4 path.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines any kernel (see tests/conftest.py)

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these run in the interpreter; tests/gpu runs the kernels on the GPU", allow_module_level=True)

from engine.kernels.triton.paged_attention import paged_decode, paged_extend  # noqa: E402
from engine.kv.int4 import Int4KV  # noqa: E402
from engine.kv.pool import allocate_kv_pool  # noqa: E402
from kvtypes.sampling_params import SamplingParams  # noqa: E402
from tests.engine.kv.test_int4_kv import fill, ref_block, ref_decode  # noqa: E402

CPU = torch.device("cpu")


def pool_with(lengths, kv_heads, head_dim, block_size, seed):
    pool = allocate_kv_pool(48, block_size, 1, kv_heads, head_dim, "int4", torch.float32, CPU, residual_slots=8)
    tables, _ = fill(pool, pool[0][0].state, lengths, block_size, kv_heads, head_dim, seed)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return pool[0], tables, table


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (4, 2, 16, 4), (2, 2, 24, 16), (6, 2, 64, 16), (4, 1, 32, 32)])
def test_int4_decode_equals_the_reference(heads, kv_heads, head_dim, block_size):
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    (k, v), tables, table = pool_with(lengths, kv_heads, head_dim, block_size, seed=head_dim + block_size)
    assert k.state.open_blocks  # partial last blocks are read from the residual
    q = torch.randn(len(lengths), heads, head_dim, generator=torch.Generator().manual_seed(3))
    out = paged_decode(q, k, v, table, torch.tensor(lengths, dtype=torch.int32), head_dim ** -0.5,
                       max_len=max(lengths), block_n=16)
    np.testing.assert_allclose(out.double().numpy(), ref_decode(q, k, v, tables, lengths), rtol=1e-4, atol=1e-4)


def test_int4_decode_split_k():
    lengths = [70, 33]
    (k, v), tables, table = pool_with(lengths, 2, 16, 4, seed=5)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    out = paged_decode(q, k, v, table, torch.tensor(lengths, dtype=torch.int32), 0.25, max_len=70,
                       num_splits=3, block_n=16)
    np.testing.assert_allclose(out.double().numpy(), ref_decode(q, k, v, tables, lengths), rtol=1e-4, atol=1e-4)


def test_int4_extend_chunks_over_cached_prefixes():
    bs, kvh, heads, d = 4, 2, 4, 16
    lengths = [11, 6]  # chunks of 5 and 3 new tokens: their last positions
    q_lens = [5, 3]
    (k, v), tables, table = pool_with(lengths, kvh, d, bs, seed=9)
    q = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(6))
    out = torch.zeros_like(q)
    paged_extend(q, k, v, table, torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                 out, d ** -0.5, seq_offset=0, num_seqs=2, max_query_len=5, block_m=16, block_n=16)
    row = 0
    for table_row, n, q_len in zip(tables, lengths, q_lens):
        blocks = [ref_block(k, v, b) for b in table_row]
        keys = np.concatenate([kb for kb, _ in blocks])[:n]
        values = np.concatenate([vb for _, vb in blocks])[:n]
        for i in range(q_len):
            pos = n - q_len + i
            for h in range(heads):
                s = keys[:pos + 1, h // 2] @ q[row + i, h].double().numpy() / np.sqrt(d)
                p = np.exp(s - s.max())
                np.testing.assert_allclose(out[row + i, h].double().numpy(), (p / p.sum()) @ values[:pos + 1, h // 2],
                                           rtol=1e-4, atol=1e-4)
        row += q_len


def test_engine_int4_on_triton_equals_the_torch_int4_path():
    """A prefix hit, chunked prefill and batched greedy decode give the torch int4 path's tokens
    and logprobs; no block is held at the end."""
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1))
    shared = [random.Random(20).randrange(3, 128) for _ in range(9)]
    prompts = [shared + [20, 21], list(range(40, 45)), shared + [30]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        engine = tiny_engine(hf, max_num_batched_tokens=8, attention_backend=backend, kv_cache_dtype="int4")
        assert engine.runner.model.attn.name == backend
        assert isinstance(engine.runner.kv_caches[0][0], Int4KV)
        results[backend] = engine.generate(prompts[:2], params) + engine.generate(prompts[2:], params)
        assert results[backend][2].num_cached_tokens == 8
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
    for ref, got in zip(results["torch"], results["triton"]):
        assert got.token_ids == ref.token_ids
        for step, (a, b) in enumerate(zip(ref.logprobs, got.logprobs)):
            # The torch backend attends a prompt's first chunk (no cached prefix) to its own
            # unquantized K/V; Triton reads it from the pool (as the int8 test says).
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4 if step else 5e-2)
