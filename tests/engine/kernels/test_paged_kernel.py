"""The native paged decode kernel equals gather + SDPA on the same pool, shape for shape (fp32,
fp16 pools widened to fp32, int8 codes against the torch int8 reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def reference(q, k_cache, v_cache, tables, lens):
    """Each row gathered on its own, unpadded, through SDPA: [B, H, d]."""
    bs = k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = tables[b, :(n + bs - 1) // bs]
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, kvH, n, d]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


# head_dim 40, 96, 128: the AVX2 path's channel slices of 64, then 32, 16, 8; 12: the portable path
SHAPES = [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8), (8, 2, 40, 16), (4, 2, 96, 8), (2, 1, 128, 16), (4, 2, 12, 4)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("one_row", [False, True])  # one row: a job per kv head; six: a job per row
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_gather_and_sdpa(heads, kv_heads, head_dim, block_size, one_row, kv_dtype):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    # Lengths at and around block edges, a single token, and rows with unused table tail.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size, 7])
    if one_row:
        lens = torch.tensor([5 * block_size - 3])
    width = 5
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    got = torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    assert got.dtype == torch.float32
    want = reference(q, k_cache.float(), v_cache.float(), tables, lens)  # fp16 values are exact in fp32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_long_rows_match_and_do_not_depend_on_the_job_split(kv_dtype):
    """Rows of ~1,000 tokens in a 1B model's shape (32 heads on 8 kv heads, groups of 4 query heads
    on one kv head): they equal gather + SDPA, and a row's output is the same floats alone (a job
    per kv head) as among five others (a job per row, every group in turn): each head's sums are
    taken in one order whichever job holds it."""
    gen = torch.Generator().manual_seed(1000)
    heads, kv_heads, head_dim, block_size, width = 32, 8, 64, 16, 64
    k_cache = torch.randn(6 * width, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(6 * width, block_size, kv_heads, head_dim, generator=gen).to(kv_dtype)
    lens = torch.tensor([1000, 1001, 999, 17, 1023, 640])
    tables = torch.randperm(6 * width, generator=gen).view(6, width)
    q = torch.randn(6, heads, head_dim, generator=gen)
    got = torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(got, reference(q, k_cache.float(), v_cache.float(), tables, lens), atol=1e-5, rtol=1e-5)
    for b in (0, 1, 3):
        alone = torch.ops.kvserve.paged_decode_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], lens[b:b + 1],
                                                         head_dim ** -0.5)
        assert torch.equal(alone[0], got[b])


def test_shared_blocks_and_empty_batch():
    k_cache = torch.randn(8, 4, 2, 8)
    v_cache = torch.randn(8, 4, 2, 8)
    tables = torch.tensor([[3, 5], [3, 6]])  # a shared prefix block, as after a prefix-cache hit
    lens = torch.tensor([6, 8])
    q = torch.randn(2, 4, 8)
    got = torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, 8 ** -0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)
    empty = torch.ops.kvserve.paged_decode_attention(q[:0], k_cache, v_cache, tables[:0], lens[:0], 1.0)
    assert empty.shape == (0, 4, 8)


def test_rejects_bad_input():
    k_cache = torch.randn(8, 4, 2, 8)
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.kvserve.paged_decode_attention(q.double(), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                                                 torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="two fp32 or two fp16 pools"):
        torch.ops.kvserve.paged_decode_attention(q, k_cache.half(), k_cache, torch.zeros(1, 2, dtype=torch.long),
                                                 torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        torch.ops.kvserve.paged_decode_attention(q, k_cache, k_cache, torch.zeros(1, 2, dtype=torch.long),
                                                 torch.tensor([9]), 1.0)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8)])
def test_int8_pools_match_the_torch_int8_reference(heads, kv_heads, head_dim, block_size):
    """The int8 kernel against gather + dequantize + SDPA (the torch backend's int8 path) over the
    same codes: ragged lengths, block edges, GQA/MHA/MQA, keys with a large one-signed channel."""
    from engine.kv.int8 import Int8KV, dequantize, write_int8

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    num_blocks = 64
    k = Int8KV.zeros((num_blocks, block_size, kv_heads, head_dim), torch.float32, torch.device("cpu"))
    v = Int8KV.zeros((num_blocks, block_size, kv_heads, head_dim), torch.float32, torch.device("cpu"))
    keys = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    keys[..., 3] += 8.0  # an outlier channel of one sign, as real keys have
    write_int8(k, keys, torch.arange(num_blocks * block_size))
    write_int8(v, torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen) * 2 + 0.5,
               torch.arange(num_blocks * block_size))
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size, 7])
    width = 5
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    k_deq = dequantize(k.data, k.scale, torch.float32)
    v_deq = dequantize(v.data, v.scale, torch.float32)
    threads = torch.get_num_threads()
    try:
        # 1 thread: a job per sequence; as many threads as rows: a job per kv head of a sequence.
        for n in (1, len(lens)):
            torch.set_num_threads(n)
            got = torch.ops.kvserve.paged_decode_attention_int8(q, k.data, k.scale, v.data, v.scale, tables, lens,
                                                                head_dim ** -0.5)
            torch.testing.assert_close(got, reference(q, k_deq, v_deq, tables, lens), atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(threads)
    # It really read the codes: against the unquantized keys the answer differs.
    assert not torch.allclose(got, reference(q, keys.view(k_deq.shape), v_deq, tables, lens), atol=1e-5)


def test_int8_rejects_bad_scales():
    codes = torch.zeros(8, 4, 2, 8, dtype=torch.int8)
    q = torch.randn(1, 4, 8)
    tables, lens = torch.zeros(1, 2, dtype=torch.long), torch.tensor([3])
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.kvserve.paged_decode_attention_int8(q, codes, torch.zeros(8, 4, 2, 1), codes,
                                                      torch.zeros(8, 4, 2, 1), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="int8 codes"):
        torch.ops.kvserve.paged_decode_attention_int8(q, codes.float(), torch.zeros(8, 4, 2, 2), codes.float(),
                                                      torch.zeros(8, 4, 2, 2), tables, lens, 1.0)


def test_native_int8_write_equals_the_torch_quantizer():
    """``write_int8_kv`` stores exactly the codes and scales of ``kv_quant.quantize`` in the slots."""
    from engine.kv.int8 import Int8KV, quantize

    gen = torch.Generator().manual_seed(3)
    cache = Int8KV.zeros((6, 4, 3, 32), torch.float32, torch.device("cpu"))
    x = torch.randn(7, 3, 32, generator=gen) * 3
    x[2] = 1.5  # a constant row: zero range
    slots = torch.tensor([0, 5, 23, 9, 10, 11, 17])
    torch.ops.kvserve.write_int8_kv(x, cache.data, cache.scale, slots)
    codes, scale = quantize(x)
    assert torch.equal(cache.data.view(-1, 3, 32)[slots], codes)
    assert torch.equal(cache.scale.view(-1, 3, 2)[slots], scale)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not cache.data.view(-1, 3, 32)[untouched].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvserve.write_int8_kv(x[:1], cache.data, cache.scale, torch.tensor([24]))


def reference_mass(q, k_cache, tables, lens, width):
    """H2O's block mass, explicitly: each row's softmax over its gathered context (fp64), summed
    over heads, then per block of its table -> [B, width] (zero past a row's blocks)."""
    bs, heads, kv_heads = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    out = torch.zeros(len(lens), width, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(lens[b])
        nb = (n + bs - 1) // bs
        k = k_cache[tables[b, :nb]].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * q.shape[-1] ** -0.5, dim=-1)
        out[b, :nb] = F.pad(probs.sum(0), (0, nb * bs - n)).view(nb, bs).sum(-1)
    return out.float()


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 40, 4), (4, 2, 12, 4)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8], ids=["fp32", "fp16", "int8"])
def test_block_mass_equals_the_explicit_softmax_per_block(heads, kv_heads, head_dim, block_size, kv_dtype):
    """With ``block_mass`` the kernel adds each row's softmax mass per block of its table (over
    heads) to it, and its output is the same bit for bit. Rows of different lengths, last blocks
    partly filled, GQA; head_dim 64 and 40: the AVX2 path, 12: the portable one (the int8 kernel's
    too). One thread: a job per row; as many threads as rows: a job per (row, kv head), summed."""
    from engine.kv.int8 import Int8KV, dequantize, write_int8

    gen = torch.Generator().manual_seed(heads + head_dim)
    num_blocks, width = 64, 5
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen) * 2  # peakier softmax
    values = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    if kv_dtype == torch.int8:
        k, v = (Int8KV.zeros(shape, torch.float32, torch.device("cpu")) for _ in range(2))
        write_int8(k, keys, torch.arange(num_blocks * block_size))
        write_int8(v, values, torch.arange(num_blocks * block_size))
        k_ref = dequantize(k.data, k.scale, torch.float32)

        def attend(q, tables, lens, mass=None):
            return torch.ops.kvserve.paged_decode_attention_int8(q, k.data, k.scale, v.data, v.scale, tables, lens,
                                                                 head_dim ** -0.5, mass)
    else:
        k_cache, v_cache = keys.view(shape).to(kv_dtype), values.view(shape).to(kv_dtype)
        k_ref = k_cache.float()

        def attend(q, tables, lens, mass=None):
            return torch.ops.kvserve.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, mass)

    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size, 7])
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    want = reference_mass(q, k_ref, tables, lens, width)
    threads = torch.get_num_threads()
    try:
        for n in (1, len(lens)):
            torch.set_num_threads(n)
            for rows in (slice(None), slice(4, 5)):  # every row; one row alone (a job per kv head)
                # added to what is there, in columns [0, width) of a wider buffer
                mass = torch.full((len(lens), width + 2), 0.5)[rows]
                got = attend(q[rows], tables[rows], lens[rows], mass)
                assert torch.equal(got, attend(q[rows], tables[rows], lens[rows]))
                torch.testing.assert_close(mass[:, :width] - 0.5, want[rows], atol=2e-6 * heads, rtol=1e-5)
                assert torch.all(mass[:, width:] == 0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(want.sum(-1), torch.full((len(lens),), float(heads)), atol=1e-4)
    with pytest.raises(RuntimeError, match="block_mass must be float32"):
        attend(q, tables, lens, torch.zeros(len(lens), width - 1))
