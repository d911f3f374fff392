"""int8 KV pools in the Triton paged kernels, in Triton's interpreter on CPU.

The oracle is the torch int8 reference: the pool dequantized by ``engine.kv.int8.dequantize``
then SDPA over the gathered context. Covered: MHA, GQA and MQA; ragged lengths ending on and
just past block edges; a head_dim that is not a power of two (the kernel pads it, and padded
lanes must dequantize to 0, not to the row's minimum); split-K; prefill chunks over cached
prefixes; a bf16 model; the backend writing (quantizing) a step's K/V and reading it back; and
the engine on ``--attention-backend triton --kv-cache-dtype int8`` against the torch int8 path.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines any kernel (see tests/conftest.py)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these run in the interpreter; tests/gpu runs the kernels on the GPU", allow_module_level=True)

from engine.attention import AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk, select_attention  # noqa: E402
from engine.kv.int8 import Int8KV, dequantize, quantize  # noqa: E402
from kvtypes.sampling_params import SamplingParams  # noqa: E402
from engine.kernels.triton.paged_attention import paged_decode, paged_extend  # noqa: E402
from tests.engine.attention.test_triton_attention import BLOCK_SIZE, HEADS, tables  # noqa: E402


def int8_pool(num_blocks: int, kv_heads: int, head_dim: int, out_dtype=torch.float32, seed: int = 0):
    """K and V ``Int8KV`` pools quantized from random values with an offset and a few large
    channels (as real keys have), so that both the step and the minimum matter."""
    g = torch.Generator().manual_seed(seed)
    pools = []
    for _ in range(2):
        x = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=g) + 0.5
        x[..., 1] *= 8.0
        codes, scale = quantize(x)
        pools.append(Int8KV(codes, scale, out_dtype))
    return pools


def reference(q: torch.Tensor, k_cache: Int8KV, v_cache: Int8KV, table_row: torch.Tensor, seq_len: int):
    """Dequantize the whole pool, then SDPA over the gathered context (q: the last q_len positions)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = table_row.long()
    k = dequantize(k_cache.data[rows], k_cache.scale[rows], torch.float32).reshape(-1, kv_heads, head_dim)[:seq_len]
    v = dequantize(v_cache.data[rows], v_cache.scale[rows], torch.float32).reshape(-1, kv_heads, head_dim)[:seq_len]
    q_len = q.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("heads,head_dim", [("mha", 16), ("gqa", 16), ("mqa", 16), ("gqa4", 24)])
def test_int8_decode_ragged_lengths_at_block_edges(heads, head_dim):
    num_heads, kv_heads = HEADS[heads]
    lens = [1, 3, 4, 5, 8, 9, 23]  # 4 and 8 end on a block edge, 5 and 9 one past it
    k_cache, v_cache = int8_pool(48, kv_heads, head_dim)
    table = tables(lens, 48)
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), head_dim ** -0.5,
                       max_len=max(lens), num_splits=1, block_n=16)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1], reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=1e-5, rtol=1e-5)


def test_int8_decode_split_k():
    """Three splits of 16 tokens; the 2-token row leaves two splits empty."""
    num_heads, kv_heads = HEADS["gqa"]
    lens = [45, 33, 2, 17]
    k_cache, v_cache = int8_pool(64, kv_heads, 16, seed=2)
    table = tables(lens, 64, seed=2)
    q = torch.randn(len(lens), num_heads, 16, generator=torch.Generator().manual_seed(3))
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), 16 ** -0.5,
                       max_len=48, num_splits=3, block_n=16)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1], reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=1e-5, rtol=1e-5)


def test_int8_decode_bf16_model():
    """A bf16 model: the kernel dequantizes to bf16 before its dots, the output is bf16."""
    num_heads, kv_heads = HEADS["gqa"]
    lens = [13, 7, 10]
    k_cache, v_cache = int8_pool(32, kv_heads, 16, out_dtype=torch.bfloat16, seed=4)
    table = tables(lens, 32, shared_prefix_blocks=1, seed=4)
    q = torch.randn(len(lens), num_heads, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), 16 ** -0.5,
                       max_len=16, num_splits=1, block_n=16)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1].float(), reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("heads,head_dim", [("gqa4", 16), ("mqa", 24)])
def test_int8_extend_chunks_over_cached_prefixes(heads, head_dim):
    """Chunks after prefixes of 0, 5 (mid-block) and 8 (block edge) tokens, after a decode row
    whose output rows the kernel must leave alone (seq_offset)."""
    num_heads, kv_heads = HEADS[heads]
    q_lens = [1, 7, 3, 9]
    seq_lens = [6, 7, 8, 17]
    k_cache, v_cache = int8_pool(48, kv_heads, head_dim, seed=6)
    table = tables(seq_lens, 48, seed=6)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=torch.Generator().manual_seed(7))
    out = torch.full_like(q, 7.0)
    paged_extend(q, k_cache, v_cache, table, starts, torch.tensor(seq_lens, dtype=torch.int32), out,
                 head_dim ** -0.5, seq_offset=1, num_seqs=3, max_query_len=9, block_m=16, block_n=16)
    assert (out[:1] == 7.0).all()
    for i in range(1, 4):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows], reference(q[rows], k_cache, v_cache, table[i], seq_lens[i]),
                                   atol=1e-5, rtol=1e-5)


def test_int8_and_float_pools_do_not_mix():
    k_cache, _ = int8_pool(4, 2, 16)
    v_float = torch.zeros(4, BLOCK_SIZE, 2, 16)
    with pytest.raises(ValueError, match="both be int8 or both float"):
        paged_decode(torch.zeros(1, 4, 16), k_cache, v_float, torch.zeros(1, 1, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), 0.25, max_len=1)


def test_triton_backend_forward_quantizes_then_reads_int8():
    """TritonAttention.forward on int8 pools: the step's K/V are quantized into the pool, then a
    decode row and a prefill chunk (over blocks written in this very step) read them back."""
    num_heads, kv_heads = HEADS["gqa"]
    attn = select_attention("triton", torch.device("cpu"), torch.float32, BLOCK_SIZE)
    k_cache, v_cache = int8_pool(16, kv_heads, 16, seed=8)
    table = torch.tensor([[3, 4], [7, 8]], dtype=torch.int32)
    slots = torch.tensor([4 * 4 + 1] + [7 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3])
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(6, n, 16, generator=g) for n in (num_heads, kv_heads, kv_heads))
    layout = PagedLayout(query_start=torch.tensor([0, 1, 6], dtype=torch.int32),
                         seq_lens=torch.tensor([6, 8], dtype=torch.int32), block_table=table, num_decodes=1,
                         max_query_len=5, max_seq_len=8)
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, 1, 6, table[0].long(), None,
                                                                            torch.tensor([6]))],
                             prefills=[PrefillChunk(1, 6, 8, table[1].long(), None)], paged=layout)
    out = attn.forward(q, k, v, k_cache, v_cache, meta).view(6, num_heads, 16)
    codes, scale = quantize(k[2])
    assert k_cache.data[8, 0].equal(codes) and k_cache.scale[8, 0].equal(scale)
    torch.testing.assert_close(out[:1], reference(q[:1], k_cache, v_cache, table[0], 6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], reference(q[1:], k_cache, v_cache, table[1], 8), atol=1e-5, rtol=1e-5)


def test_engine_int8_on_triton_equals_the_torch_int8_path():
    """``--kv-cache-dtype int8 --attention-backend triton``: the engine stays on Triton, and a
    prefix hit, chunked prefill and batched greedy decode give the torch int8 path's tokens
    and logprobs. No block is held at the end."""
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1))
    shared = [random.Random(20).randrange(3, 128) for _ in range(9)]
    prompts = [shared + [20, 21], list(range(40, 45)), shared + [30]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        engine = tiny_engine(hf, max_num_batched_tokens=8, attention_backend=backend, kv_cache_dtype="int8")
        assert engine.runner.model.attn.name == backend
        assert isinstance(engine.runner.kv_caches[0][0], Int8KV)
        results[backend] = engine.generate(prompts[:2], params) + engine.generate(prompts[2:], params)
        assert results[backend][2].num_cached_tokens == 8
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
    for ref, got in zip(results["torch"], results["triton"]):
        assert got.token_ids == ref.token_ids
        assert len(got.logprobs) == 4
        for step, (a, b) in enumerate(zip(ref.logprobs, got.logprobs)):
            # The torch backend attends a prompt's first chunk (no cached prefix) to its unquantized
            # K/V; Triton reads every key from the pool. In this one-layer model that changes only
            # the first sampled token's logits; every decode step reads the same int8 pool.
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4 if step else 1e-2)


def test_padded_decode_path_on_int8_pools():
    """The bucketed decode path CUDA graphs replay (padding rows quantized into the sink block,
    a fixed split plan), run eagerly here: the same tokens and logprobs as unpadded steps."""
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1, max_position_embeddings=64))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    plain = tiny_engine(hf, num_blocks=40, attention_backend="triton", kv_cache_dtype="int8").generate(prompts, params)
    engine = tiny_engine(hf, num_blocks=40, attention_backend="triton", kv_cache_dtype="int8")
    runner = engine.runner
    runner.graphs = runner.padded_decode_runner(max_num_seqs=4, max_model_len=engine.max_model_len)
    calls = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda *a: calls.append(len(a[0])) or real_run(*a)
    padded = engine.generate(prompts, params)
    assert calls and set(calls) == {3}  # three decode rows, padded to the bucket of 4
    assert runner.kv_caches[0][0].scale[40].abs().sum() > 0  # the padding row was quantized into the sink
    for got, want in zip(padded, plain):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert engine.kv_cache.usage == 0
