"""H2O's per-block attention mass from the Triton kernels, in Triton's interpreter on CPU.

The oracle is the torch backend's explicit softmax (``engine.attention.torch_sdpa._attend_with_mass``):
on the same queries, keys, values and block size, the kernels' mass per block (summed over heads
and query rows) must equal it, and their outputs must equal the same kernels' without the export.
Covered: decode rows of several lengths with partial last blocks, GQA and MQA, split-K with
several splits (split edges inside a block when the block is longer than the key tile); prefill
chunks after cached prefixes, causal, with the decode rows' mass left alone; the backend's mixed
step against the torch backend on the same metadata (float32 and int8 pools); and the engine
under ``--kv-eviction h2o`` on triton against the same engine on torch, step by step.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines any kernel (see tests/conftest.py)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these run in the interpreter; tests/gpu runs the kernels on the GPU", allow_module_level=True)

from engine.attention import AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk, select_attention  # noqa: E402
from engine.attention.torch_sdpa import _attend_with_mass  # noqa: E402
from engine.kernels.triton.paged_attention import paged_decode, paged_extend  # noqa: E402
from engine.kv.int8 import Int8KV, quantize  # noqa: E402
from tests.engine.attention.test_triton_attention import HEADS  # noqa: E402

HEAD_DIM = 16


def pool_and_table(lens: list[int], block_size: int, kv_heads: int, seed: int):
    """Random K/V pools and a random, non-overlapping block table (int32, padded with one spare
    block past every row's need, so the export must leave that column at 0)."""
    g = torch.Generator().manual_seed(seed)
    width = math.ceil(max(lens) / block_size) + 1
    num_blocks = width * len(lens)
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    table = torch.randperm(num_blocks, generator=g).view(len(lens), width).int()
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), table


def reference(q: torch.Tensor, k_cache, v_cache, row: torch.Tensor, seq_len: int, block_size: int):
    """(out ``[q_len, H, d]``, mass ``[ceil(seq_len / block_size)]``) of queries at the context's
    last ``q_len`` positions, causal, through the torch backend's explicit softmax."""
    kv_heads = k_cache.shape[2]
    keys = k_cache[row.long()].reshape(-1, kv_heads, HEAD_DIM)[:seq_len].transpose(0, 1)[None]
    values = v_cache[row.long()].reshape(-1, kv_heads, HEAD_DIM)[:seq_len].transpose(0, 1)[None]
    q_len = q.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    out, mass = _attend_with_mass(q.transpose(0, 1)[None], keys, values, mask, block_size)
    return out[0].transpose(0, 1), mass[0]


@pytest.mark.parametrize("heads, block_size, block_n, splits", [
    ("gqa", 4, 16, 1),  # four blocks per key tile
    ("gqa4", 4, 16, 3),  # split-K: three 16-token splits
    ("mqa", 32, 16, 3),  # two key tiles per block, a split edge inside a block
])
def test_decode_mass_equals_the_reference(heads, block_size, block_n, splits):
    num_heads, kv_heads = HEADS[heads]
    lens = [1, 3, 4, 5, 17, 45]  # 4 ends on a block edge, the others in a partial block
    k_cache, v_cache, table = pool_and_table(lens, block_size, kv_heads, seed=block_size + splits)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    mass = torch.zeros(len(lens), table.shape[1] + 2)  # wider than the table, as the runner's may be
    out = paged_decode(q, k_cache, v_cache, table, seq_lens, HEAD_DIM ** -0.5, max_len=48, num_splits=splits,
                       block_n=block_n, block_mass=mass)
    plain = paged_decode(q, k_cache, v_cache, table, seq_lens, HEAD_DIM ** -0.5, max_len=48, num_splits=splits,
                         block_n=block_n)
    assert torch.equal(out, plain)
    for i, n in enumerate(lens):
        ref_out, ref_mass = reference(q[i:i + 1], k_cache, v_cache, table[i], n, block_size)
        torch.testing.assert_close(out[i:i + 1], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mass[i, :len(ref_mass)], ref_mass, atol=1e-5, rtol=1e-5)
        assert (mass[i, len(ref_mass):] == 0).all()


@pytest.mark.parametrize("block_size", [4, 32])
def test_extend_mass_equals_the_reference(block_size):
    """Chunks after prefixes of 0, 5 and 8 tokens (and one of 8 rows past the 16-row query tile);
    the two decode rows' mass (seq_offset) keeps what it held."""
    num_heads, kv_heads = HEADS["gqa4"]
    q_lens = [1, 1, 7, 3, 18, 6]
    seq_lens = [6, 2, 7, 8, 26, 14]
    k_cache, v_cache, table = pool_and_table(seq_lens, block_size, kv_heads, seed=block_size)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    mass = torch.zeros(len(seq_lens), table.shape[1])
    mass[:2] = 5.0
    out, plain = torch.zeros_like(q), torch.zeros_like(q)
    for o, m in ((out, mass), (plain, None)):
        paged_extend(q, k_cache, v_cache, table, starts, lens, o, HEAD_DIM ** -0.5, seq_offset=2, num_seqs=4,
                     max_query_len=18, block_m=16, block_n=16, block_mass=m)
    assert torch.equal(out, plain)
    assert (mass[:2] == 5.0).all()
    for i in range(2, 6):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        ref_out, ref_mass = reference(q[rows], k_cache, v_cache, table[i], seq_lens[i], block_size)
        torch.testing.assert_close(out[rows], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mass[i, :len(ref_mass)], ref_mass, atol=1e-5, rtol=1e-5)
        assert (mass[i, len(ref_mass):] == 0).all()
        assert math.isclose(float(mass[i].sum()), num_heads * q_lens[i], rel_tol=1e-5)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_backend_mixed_step_exports_what_the_torch_backend_does(kv):
    """One step (two decode rows, one chunk over a cached prefix, the chunk's own K/V written in
    the same forward) through TritonAttention and TorchAttention on the same metadata and pools:
    equal outputs and equal ``meta.block_mass`` rows."""
    num_heads, kv_heads = HEADS["gqa"]
    bs = 4
    g = torch.Generator().manual_seed(3)
    raw = [torch.randn(16, bs, kv_heads, HEAD_DIM, generator=g) for _ in range(2)]

    def pools():
        if kv == "int8":
            return [Int8KV(*quantize(x), torch.float32) for x in raw]
        return [x.clone() for x in raw]

    # decodes: contexts 6 (blocks 3, 4) and 10 (blocks 9, 10, 11); chunk: 5 new tokens after 3 (blocks 7, 8)
    table = torch.tensor([[3, 4, 0], [9, 10, 11], [7, 8, 0]], dtype=torch.int32)
    slots = torch.tensor([4 * bs + 1, 11 * bs + 1, 7 * bs + 3, 8 * bs, 8 * bs + 1, 8 * bs + 2, 8 * bs + 3])
    q, k, v = (torch.randn(7, h, HEAD_DIM, generator=g) for h in (num_heads, kv_heads, kv_heads))
    lens = torch.tensor([6, 10])
    decodes = DecodeGroup(0, 2, 10, table[:2].long().flatten(),
                          (torch.arange(10)[None, :] < lens[:, None])[:, None, None, :], lens)
    chunk = PrefillChunk(2, 7, 8, table[2, :2].long(),
                         torch.arange(8)[None, :] <= torch.arange(3, 8)[:, None])
    layout = PagedLayout(query_start=torch.tensor([0, 1, 2, 7], dtype=torch.int32),
                         seq_lens=torch.tensor([6, 10, 8], dtype=torch.int32), block_table=table, num_decodes=2,
                         max_query_len=5, max_seq_len=10)
    results = {}
    for name in ("torch", "triton"):
        attn = select_attention(name, torch.device("cpu"), torch.float32, bs,
                                kv_cache_dtype="auto" if kv == "float32" else kv)
        assert attn.exports_block_mass
        meta = AttentionMetadata(slots, [decodes], [chunk], paged=layout if name == "triton" else None,
                                 block_mass=torch.zeros(3, 3))
        k_cache, v_cache = pools()
        results[name] = attn.forward(q, k, v, k_cache, v_cache, meta), meta.block_mass
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-5, rtol=1e-5)
    assert results["triton"][1][0, 2] == 0 and results["triton"][1][2, 2] == 0  # past each row's blocks


def test_engine_h2o_on_triton_equals_the_torch_backend():
    """The engine with ``kv_eviction h2o`` on triton and on torch: the same per-step block mass
    (every layer, head and query row, in the runner's row order), the same evictions, the same
    greedy tokens; chunked prefill and decode both evict."""
    from kvtypes.sampling_params import SamplingParams
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1, max_position_embeddings=128))
    prompt = [(i * 7) % 120 + 3 for i in range(36)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        engine = tiny_engine(hf, block_size=4, num_blocks=64, max_num_batched_tokens=8, attention_backend=backend,
                             kv_eviction="h2o", kv_budget_tokens=16, kv_recent_tokens=4, cuda_graphs=False)
        assert engine.runner.model.attn.name == backend
        steps: list[torch.Tensor] = []
        collect = engine.runner._collect_block_mass

        def record(ordered, mass, collect=collect, steps=steps):
            steps.append(mass.clone())
            collect(ordered, mass)

        engine.runner._collect_block_mass = record
        out = engine.generate([prompt], params)[0]
        runs[backend] = out.token_ids, steps, engine.kv_cache.num_evicted_blocks_total
    (want, want_steps, want_evicted), (got, got_steps, got_evicted) = runs["torch"], runs["triton"]
    assert want_evicted > 0 and got_evicted == want_evicted
    assert got == want
    assert len(got_steps) == len(want_steps)
    for a, b in zip(want_steps, got_steps):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)
