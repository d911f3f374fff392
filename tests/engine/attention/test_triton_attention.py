"""The Triton paged kernels against the torch reference, in Triton's interpreter on CPU.

Covered: MHA, GQA and MQA; contexts ending on and just past block edges; sequences that
share prefix blocks; ragged lengths in one batch; split-K decode with several non-empty
splits (and empty trailing ones); prefill chunks over a cached prefix; bf16 pools; and the
engine end to end on the triton backend against transformers. Shapes are tiny: the
interpreter runs every program instance in Python.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines any kernel (see tests/conftest.py)

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these run in the interpreter; tests/gpu runs the kernels on the GPU", allow_module_level=True)

from engine.attention import AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk, select_attention  # noqa: E402
from engine.kernels.triton.paged_attention import combine_splits, paged_decode, paged_extend, plan_splits  # noqa: E402

HEADS = {"mha": (4, 4), "gqa": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}
BLOCK_SIZE = 4
HEAD_DIM = 16


def make_pool(num_blocks: int, kv_heads: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def tables(lens: list[int], num_blocks: int, shared_prefix_blocks: int = 0, seed: int = 0) -> torch.Tensor:
    """A random block table per sequence (int32, padded with block 0); the first
    ``shared_prefix_blocks`` blocks are the same for every sequence."""
    rng = random.Random(seed)
    width = max(math.ceil(n / BLOCK_SIZE) for n in lens)
    shared = rng.sample(range(num_blocks), shared_prefix_blocks)
    rows = []
    for n in lens:
        need = math.ceil(n / BLOCK_SIZE)
        own = rng.sample([b for b in range(num_blocks) if b not in shared], max(0, need - len(shared)))
        row = (shared + own)[:need]
        rows.append(row + [0] * (width - need))
    return torch.tensor(rows, dtype=torch.int32)


def reference(q: torch.Tensor, k_cache, v_cache, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """SDPA over the gathered context: q ``[q_len, H, d]`` are the last q_len positions."""
    kv_heads = k_cache.shape[2]
    k = k_cache[table_row.long()].reshape(-1, kv_heads, HEAD_DIM)[:seq_len].float()
    v = v_cache[table_row.long()].reshape(-1, kv_heads, HEAD_DIM)[:seq_len].float()
    q_len = q.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("heads", list(HEADS))
def test_decode_ragged_lengths_at_block_edges(heads):
    num_heads, kv_heads = HEADS[heads]
    lens = [1, 3, 4, 5, 8, 9, 23]  # 4 and 8 end on a block edge, 5 and 9 one past it
    k_cache, v_cache = make_pool(48, kv_heads)
    table = tables(lens, 48)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), HEAD_DIM ** -0.5,
                       max_len=max(lens), num_splits=1, block_n=16)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1], reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_decode_split_k_matches_one_split(heads):
    """Three splits of 16 tokens over contexts of up to 45 tokens: the merged output equals
    the reference; the 2-token sequence leaves two of its splits empty."""
    num_heads, kv_heads = HEADS[heads]
    lens = [45, 33, 2, 17]
    k_cache, v_cache = make_pool(64, kv_heads, seed=2)
    table = tables(lens, 64, seed=2)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), HEAD_DIM ** -0.5,
                       max_len=48, num_splits=3, block_n=16)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1], reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=1e-5, rtol=1e-5)


def test_decode_shared_prefix_blocks_bf16():
    num_heads, kv_heads = HEADS["gqa"]
    lens = [13, 13, 10]
    k_cache, v_cache = make_pool(32, kv_heads, dtype=torch.bfloat16, seed=4)
    table = tables(lens, 32, shared_prefix_blocks=2, seed=4)
    assert table[0, :2].tolist() == table[2, :2].tolist()
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = paged_decode(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), HEAD_DIM ** -0.5,
                       max_len=16, num_splits=1, block_n=16)
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i:i + 1].float(), reference(q[i:i + 1], k_cache, v_cache, table[i], n),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads", ["mha", "gqa4", "mqa"])
def test_extend_chunks_over_cached_prefixes(heads):
    """Chunks after prefixes of 0 (fresh prompt), 5 (mid-block) and 8 (block edge) tokens,
    ragged chunk lengths, two chunks sharing their prefix blocks, after two decode rows
    whose rows the kernel must leave alone (seq_offset)."""
    num_heads, kv_heads = HEADS[heads]
    q_lens = [1, 1, 7, 3, 18, 6]
    seq_lens = [6, 2, 7, 8, 26, 14]  # prefixes: -, -, 0, 5, 8, 8
    k_cache, v_cache = make_pool(64, kv_heads, seed=6)
    table = tables(seq_lens, 64, shared_prefix_blocks=0, seed=6)
    table[5, :2] = table[4, :2]  # the last two chunks share their 8-token prefix
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    out = torch.full_like(q, 7.0)
    paged_extend(q, k_cache, v_cache, table, starts, torch.tensor(seq_lens, dtype=torch.int32), out,
                 HEAD_DIM ** -0.5, seq_offset=2, num_seqs=4, max_query_len=18, block_m=16, block_n=16)
    assert (out[:2] == 7.0).all()
    for i in range(2, 6):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(out[rows], reference(q[rows], k_cache, v_cache, table[i], seq_lens[i]),
                                   atol=1e-5, rtol=1e-5)


def test_combine_and_plan_splits():
    partial = torch.randn(2, 3, 4, 8)
    lse = torch.randn(2, 3, 4)
    lse[0, :, 3] = float("-inf")  # an empty split weighs nothing
    merged = combine_splits(partial, lse)
    w = torch.softmax(lse, -1)
    torch.testing.assert_close(merged, (partial * w.unsqueeze(-1)).sum(2))
    assert plan_splits(100, 1) == (1, 128)  # short context: one split
    splits, size = plan_splits(8192, 8)  # batch 1 x 8 KV heads at 8k: split to fill the GPU
    assert splits * size >= 8192 and size % 64 == 0 and splits == 32
    assert plan_splits(8192, 512)[0] == 1  # a large batch fills the GPU alone


def test_backend_forward_mixed_step():
    """TritonAttention.forward: write the step's K/V, then decode rows and a prefill chunk
    that attends to blocks written in this very step by the same forward."""
    num_heads, kv_heads = HEADS["gqa"]
    attn = select_attention("triton", torch.device("cpu"), torch.float32, BLOCK_SIZE)
    k_cache, v_cache = make_pool(16, kv_heads, seed=8)
    # decode row: context 6 in blocks [3, 4]; chunk: 5 new tokens after a 3-token prefix, blocks [7, 8]
    table = torch.tensor([[3, 4], [7, 8]], dtype=torch.int32)
    slots = torch.tensor([4 * 4 + 1] + [7 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3])
    g = torch.Generator().manual_seed(9)
    q = torch.randn(6, num_heads, HEAD_DIM, generator=g)
    k = torch.randn(6, kv_heads, HEAD_DIM, generator=g)
    v = torch.randn(6, kv_heads, HEAD_DIM, generator=g)
    layout = PagedLayout(query_start=torch.tensor([0, 1, 6], dtype=torch.int32),
                         seq_lens=torch.tensor([6, 8], dtype=torch.int32), block_table=table, num_decodes=1,
                         max_query_len=5, max_seq_len=8)
    meta = AttentionMetadata(slot_mapping=slots, decode_groups=[DecodeGroup(0, 1, 6, table[0].long(), None,
                                                                            torch.tensor([6]))],
                             prefills=[PrefillChunk(1, 6, 8, table[1].long(), None)], paged=layout)
    out = attn.forward(q, k, v, k_cache, v_cache, meta).view(6, num_heads, HEAD_DIM)
    assert k_cache[8, 0].equal(k[2]) and v_cache[4, 1].equal(v[0])
    torch.testing.assert_close(out[:1], reference(q[:1], k_cache, v_cache, table[0], 6), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:], reference(q[1:], k_cache, v_cache, table[1], 8), atol=1e-5, rtol=1e-5)


def test_engine_on_triton_backend_matches_transformers():
    """The whole engine on the triton backend: prefix hit, chunked prefill and batched
    decode, logits equal to transformers'."""
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1))
    engine = tiny_engine(hf, max_num_batched_tokens=8, attention_backend="triton")
    recorder = LogitRecorder(engine)
    shared = list(range(3, 14))
    engine.generate([shared + [20, 21], list(range(40, 46))], GREEDY)
    hit = engine.generate([shared + [30]], GREEDY)[0]  # a prefix hit on the first prompt's blocks
    assert hit.num_cached_tokens == 8
    assert check_against_hf(hf, recorder) >= 12
