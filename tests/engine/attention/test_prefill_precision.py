"""``prefill_attention_dtype``: which kernel a bf16 prefill chunk takes, and that it attends to q,
k and v rounded to bf16 (against a float64 reference of those rounded values), with and without a
cached prefix, while decode rows do not (how ``auto`` resolves: tests/engine/test_prefill_dtype.py)."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk, TorchAttention
from engine.attention.native import NativeAttention, native_prefill_runs
from engine.platform.cpu_features import flags_of

HEADS, KV_HEADS, HEAD_DIM, BS = 9, 3, 64, 16  # SmolLM2's attention shape


def test_cpuinfo_flags_are_read_from_the_flags_line():
    text = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"
    assert flags_of(text) == {"fpu", "avx512f", "amx_bf16", "amx_tile", "amx_int8"}
    assert flags_of("model name\t: Graviton\nFeatures\t: fp asimd\n") == frozenset()


def test_the_startup_log_names_what_multiplies_prefill_chunks():
    """The ``Attention:`` line says which kernel prefill chunks take in the dtype they attend in: the
    native backend's own (AMX-BF16 tiles for bf16 chunks, AVX2 vectors for fp32 ones) where it runs
    for the head size (this CPU's answer, asked of the kernel library), else torch SDPA with the
    reason; the torch backend always SDPA."""
    native = NativeAttention()
    native.prefill_dtype = torch.bfloat16
    if native_prefill_runs(64, torch.bfloat16):
        assert native.prefill_kernel(64) == "kvserve's AMX-BF16 kernel"
    else:
        assert native.prefill_kernel(64).startswith("torch SDPA (kvserve's AMX-BF16 kernel needs")
    assert native.prefill_kernel(48).startswith("torch SDPA (")  # no multiple of 32: never the kernel
    native.prefill_dtype = None  # the model's: float32
    if native_prefill_runs(64, torch.float32):
        assert native.prefill_kernel(64) == native.prefill_kernel(48) == "kvserve's AVX2 fp32 kernel"
    else:
        assert native.prefill_kernel(64).startswith("torch SDPA (kvserve's AVX2 fp32 kernel needs")
    assert native.prefill_kernel(40).startswith("torch SDPA (")  # no multiple of 16: never the kernel
    assert TorchAttention().prefill_kernel(64) == "torch SDPA"


def test_prefill_on_tiles_only_where_bf16_chunks_take_the_amx_kernel():
    """What the native decode path asks before it takes a chunk of many rows (NativeDecoder.chunks_fit)."""
    native = NativeAttention()
    assert not native.prefill_on_tiles(64)  # the model's float32: the AVX2 kernel or SDPA
    native.prefill_dtype = torch.bfloat16
    assert native.prefill_on_tiles(64) == native_prefill_runs(64, torch.bfloat16)
    assert not native.prefill_on_tiles(48)  # SDPA's flash kernel, not kvserve's tiles
    torch_backend = TorchAttention()
    torch_backend.prefill_dtype = torch.bfloat16
    assert not torch_backend.prefill_on_tiles(64)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """float64 attention of q ``[n, H, d]`` at positions ``first_pos..`` over keys / values
    ``[L, KVH, d]`` (causal) -> ``[n, H, d]``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * q.shape[-1] ** -0.5
    visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("prefix", [0, 48])
def test_a_bf16_prefill_chunk_attends_to_its_inputs_rounded_to_bf16(prefix, backend):
    """A step of one decode row and one prefill chunk of 37 tokens after ``prefix`` cached ones,
    over an fp16 pool (the CPU default): the chunk's output is the float64 attention of q, k and
    v as the pool holds them, rounded to bf16, within bf16's rounding of the probabilities and
    the output; the same step in float32 is nearer the unrounded reference; the decode row is
    the same in both (it does not take the prefill dtype). ``native``: the same through the
    AMX-BF16 prefill kernel (engine/kernels/cpu/prefill_attention.cpp), where the CPU has it."""
    if backend == "native" and not native_prefill_runs(HEAD_DIM, torch.bfloat16):
        pytest.skip("no AMX-BF16 prefill kernel on this CPU")
    gen = torch.Generator().manual_seed(prefix)
    n, blocks = 37, 16
    k_cache = torch.zeros(blocks, BS, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    context = prefix + n
    # the chunk's sequence owns blocks 0..; the decode row's context (20 tokens) blocks 10, 11
    past_k, past_v = (torch.randn(prefix + 20, KV_HEADS, HEAD_DIM, generator=gen) * 2 for _ in range(2))
    chunk_slots = torch.arange(prefix)
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[chunk_slots] = past_k[:prefix].half()
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[chunk_slots] = past_v[:prefix].half()
    row_slots = 10 * BS + torch.arange(19)
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[row_slots] = past_k[prefix:prefix + 19].half()
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[row_slots] = past_v[prefix:prefix + 19].half()
    q = torch.randn(1 + n, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(1 + n, KV_HEADS, HEAD_DIM, generator=gen) * 2
    v = torch.randn(1 + n, KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.cat([torch.tensor([10 * BS + 19]), prefix + torch.arange(n)])
    chunk_blocks = torch.arange(-(-context // BS))
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode_groups=[DecodeGroup(0, 1, 20, torch.tensor([10, 11]), None, torch.tensor([20]))],
        prefills=[PrefillChunk(1, 1 + n, context, chunk_blocks if prefix else None, None)])

    def run(dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn = NativeAttention() if backend == "native" else TorchAttention()
        attn.prefill_dtype = dtype
        kc, vc = k_cache.clone(), v_cache.clone()
        out = attn.forward(q, k, v, kc, vc, meta).view(1 + n, HEADS, HEAD_DIM)
        return out, kc, vc

    got, k_pool, v_pool = run(torch.bfloat16)
    exact, _, _ = run(None)
    # the chunk's context as the pool holds it after the step's write (fp16)
    keys = k_pool.view(-1, KV_HEADS, HEAD_DIM)[:context].float()
    values = v_pool.view(-1, KV_HEADS, HEAD_DIM)[:context].float()
    want_bf16 = reference(bf16(q[1:]), bf16(keys), bf16(values), prefix)
    want_exact = reference(q[1:], keys, values, prefix)
    err_bf16 = (got[1:].double() - want_bf16).abs()
    err_exact = (got[1:].double() - want_exact).abs()
    # within bf16's rounding of the probabilities and the output (~2^-9 of the values' scale), and
    # nearer the reference of the rounded inputs than the unrounded one's (measured 0.0007-0.0009
    # mean against 0.0015-0.0022): q, k and v were rounded, not only the output
    assert err_bf16.max().item() < 2e-2, err_bf16.max()
    assert err_bf16.mean().item() < 0.6 * err_exact.mean().item(), (err_bf16.mean(), err_exact.mean())
    assert (exact[1:].double() - want_exact).abs().max().item() < 1e-5  # the float32 step: exact
    assert torch.equal(got[:1], exact[:1])  # the decode row: fp32 either way
