"""Paged attention in Triton over the block pool ``[num_blocks, block_size, kv_heads, d]``.

Two kernels, both reading keys and values in place through a block table (int32, one row
per sequence) and each sequence's context length:

* ``paged_decode``: one query token per sequence. A program owns one (sequence, KV head,
  split): all query heads of the KV head's group attend together (the keys are read once per
  group, not once per head), over the split's slice of the context. With more than one split
  (flash-decoding / split-K for long contexts and small batches) each split writes its
  partial output and log-sum-exp, and ``combine_splits`` merges them exactly.
* ``paged_extend``: prefill chunks. A program owns one (chunk, head, tile of query rows);
  the chunk's queries are the last ``q_len`` positions of a ``seq_len``-token context whose
  keys (the cached prefix and the chunk itself, already written to the pool) are read from
  the blocks with a causal mask.

int8 pools (``Int8KV``, engine/kv/int8.py: codes plus a float32 (step, minimum) per token
and head) are read as codes and dequantized in registers by ``_load_kv_tile`` (``KV_INT8``),
a quarter of fp32's (half of bf16's) bytes per key instead of a dequantized copy. int4 pools
(``Int4KV``, engine/kv/int4.py: KIVI's packed 4-bit codes, keys with a (step, minimum) per channel
and block, values per token, open blocks in a residual of the model's dtype) are read the same
way (``KV_INT4``): each token's block is taken from the residual where ``slot_of[block] >= 0``.

H2O block mass (``block_mass=`` on either wrapper): the ``MASS`` constexpr makes each program
also store, per key tile, every (query row, head)'s log-sum-exp of the raw scores over each block
of the tile (``_store_granule_lse``); after the launch ``exp(block_lse - row_lse)``, summed over
heads (and a chunk's rows), is the mass per block, the probabilities the values were weighed with.
One pass over K/V; ``MASS=False`` compiles the plain kernel.

Softmax runs online in float32; dots take the pool's dtype (bf16/fp16 on tensor cores,
float32 with IEEE precision). Every launch is free of host synchronisation, so a decode step
can be captured in a CUDA graph when its split count is fixed (``num_splits``). Tile sizes
are fixed per call site, never derived from a step's lengths, so a serving run compiles each
kernel once per (dtype, head layout, block size) and never mid-run.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from engine.kv.int4 import Int4KV
from engine.kv.int8 import Int8KV

# Below this many tokens per split a split does not pay for its partial write and merge.
MIN_SPLIT_TOKENS = 256
# Enough programs to fill an H100/H200 (132 SMs) about twice.
TARGET_PROGRAMS = 256


@triton.jit
def _load_kv_tile(K, V, KS, VS, KR, VR, SLOT, bt_row, n, nmask, d, dmask, kvh, stride_kb, stride_kt, stride_kh,
                  stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
                  stride_vsh, stride_rb, stride_rt, stride_rh,
                  BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr, KV_INT8: tl.constexpr, KV_INT4: tl.constexpr):
    """Keys and values ``[BLOCK_N, HEAD_DIM_P]`` of token positions ``n`` of one sequence (its
    block-table row at ``bt_row``), read in place from the paged pool; masked entries are 0.

    ``KV_INT8``: ``K``/``V`` hold int8 codes and ``KS``/``VS`` float32 ``(step, minimum)`` per
    token and head (engine/kv/int8.py); the tile is dequantized here, in registers, to float32
    (the caller casts it to the query's dtype). Otherwise ``KS``/``VS`` are never read.

    ``KV_INT4``: ``K``/``V`` hold uint8 bytes of two codes (channel 2i low), ``KS`` the keys'
    float16 ``[blocks, kv_heads, 2, d]`` ((step, minimum) rows; ``stride_kst`` steps from one to
    the other), ``VS`` the values' ``[blocks, block_size, kv_heads, 2]``, ``KR``/``VR`` the open
    blocks' rows and ``SLOT`` each block's residual slot (-1: quantized)."""
    blk = tl.load(bt_row + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    off = n % BLOCK_SIZE
    kv_mask = nmask[:, None] & dmask[None, :]
    if KV_INT4:
        slot = tl.load(SLOT + blk, mask=nmask, other=-1).to(tl.int64)
        is_open = (slot >= 0)[:, None] & kv_mask
        shift = ((d % 2) * 4)[None, :].to(tl.uint8)
        kb = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh + (d // 2)[None, :],
                     mask=kv_mask, other=0)
        vb = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh + (d // 2)[None, :],
                     mask=kv_mask, other=0)
        kc = ((kb >> shift) & 15).to(tl.float32)
        vc = ((vb >> shift) & 15).to(tl.float32)
        ks = KS + blk[:, None] * stride_ksb + kvh * stride_ksh + d[None, :]
        k_step = tl.load(ks, mask=kv_mask, other=0.0).to(tl.float32)
        k_min = tl.load(ks + stride_kst, mask=kv_mask, other=0.0).to(tl.float32)
        vs = VS + blk * stride_vsb + off * stride_vst + kvh * stride_vsh
        v_step = tl.load(vs, mask=nmask, other=0.0).to(tl.float32)
        v_min = tl.load(vs + 1, mask=nmask, other=0.0).to(tl.float32)
        res = (tl.where(slot >= 0, slot, 0)[:, None] * stride_rb + off[:, None] * stride_rt + kvh * stride_rh
               + d[None, :])
        kr = tl.load(KR + res, mask=is_open, other=0.0).to(tl.float32)
        vr = tl.load(VR + res, mask=is_open, other=0.0).to(tl.float32)
        k = tl.where(is_open, kr, tl.where(kv_mask, kc * k_step + k_min, 0.0))
        v = tl.where(is_open, vr, tl.where(kv_mask, vc * v_step[:, None] + v_min[:, None], 0.0))
        return k, v
    k = tl.load(K + blk[:, None] * stride_kb + off[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                mask=kv_mask, other=0)
    v = tl.load(V + blk[:, None] * stride_vb + off[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=kv_mask, other=0)
    if KV_INT8:
        ks = KS + blk * stride_ksb + off * stride_kst + kvh * stride_ksh
        vs = VS + blk * stride_vsb + off * stride_vst + kvh * stride_vsh
        k_step = tl.load(ks, mask=nmask, other=0.0)
        k_min = tl.load(ks + 1, mask=nmask, other=0.0)
        v_step = tl.load(vs, mask=nmask, other=0.0)
        v_min = tl.load(vs + 1, mask=nmask, other=0.0)
        # Masked entries (past the context, past head_dim) must stay 0, not the row's minimum.
        k = tl.where(kv_mask, (k.to(tl.float32) + 128.0) * k_step[:, None] + k_min[:, None], 0.0)
        v = tl.where(kv_mask, (v.to(tl.float32) + 128.0) * v_step[:, None] + v_min[:, None], 0.0)
    elif DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _store_granule_lse(G, rows, stride_row, rmask, p, m_row, n0, num_granules, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, GRANULE: tl.constexpr):
    """Block-mass export (``MASS``): for the tile of keys ``n0 .. n0 + BLOCK_N - 1`` whose
    ``p = exp(score - m_row)`` ``[ROWS, BLOCK_N]`` the online softmax just computed, store each
    row's log-sum-exp of the raw scores over every ``GRANULE`` keys, ``m_row + log(sum p)``, at
    ``G + rows * stride_row + n0 // GRANULE + i`` (granules past ``num_granules`` dropped). An
    absolute quantity, so it needs no rescaling when the running maximum moves later:
    ``exp(granule_lse - row_lse)`` is the granule's softmax mass. ``n0`` is a multiple of
    ``BLOCK_N`` and ``GRANULE`` divides both ``BLOCK_N`` and the pool's block size, so a granule
    lies in one block. A granule with no visible key stores -inf."""
    NUM: tl.constexpr = BLOCK_N // GRANULE
    part = tl.sum(tl.reshape(p, [ROWS, NUM, GRANULE]), 2)
    gi = n0 // GRANULE + tl.arange(0, NUM)
    seen = part > 0
    lse = tl.where(seen, m_row[:, None] + tl.log(tl.where(seen, part, 1.0)), float("-inf"))
    tl.store(G + rows[:, None].to(tl.int64) * stride_row + gi[None, :], lse,
             mask=rmask[:, None] & (gi < num_granules)[None, :])


@triton.jit
def _decode_kernel(Q, K, V, KS, VS, KR, VR, SLOT, BT, LENS, OUT, LSE, scale,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_rb, stride_rt,
                   stride_rh, stride_bt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, split_tokens,
                   GLSE, stride_gb, stride_gh, num_granules,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, KV_INT8: tl.constexpr, KV_INT4: tl.constexpr,
                   MASS: tl.constexpr, GRANULE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    start = s * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        k, v = _load_kv_tile(K, V, KS, VS, KR, VR, SLOT, BT + b * stride_bt, n, nmask, d, dmask, kvh, stride_kb,
                             stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh,
                             stride_vsb, stride_vst, stride_vsh, stride_rb, stride_rt, stride_rh, BLOCK_SIZE, DOT_F32,
                             KV_INT8, KV_INT4)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        scores = tl.where(nmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        if MASS:
            _store_granule_lse(GLSE + b * stride_gb, heads, stride_gh, gmask, p, m_new, n0, num_granules, GROUP_P,
                               BLOCK_N, GRANULE)
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m = m_new
    has = lsum > 0
    out = acc / tl.where(has, lsum, 1.0)[:, None]
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :], out,
             mask=gmask[:, None] & dmask[None, :])
    lse = tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("-inf"))
    tl.store(LSE + b * stride_lb + heads * stride_lh + s, lse, mask=gmask)


@triton.jit
def _extend_kernel(Q, K, V, KS, VS, KR, VR, SLOT, BT, QSTART, LENS, OUT, scale, seq_offset,
                   stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_rb, stride_rt,
                   stride_rh, stride_bt, stride_ot, stride_oh, LSE, stride_lt, GLSE, stride_gt, stride_gh, num_granules,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, KV_INT8: tl.constexpr, KV_INT4: tl.constexpr,
                   MASS: tl.constexpr, GRANULE: tl.constexpr):
    sid = tl.program_id(0) + seq_offset
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q0 = tl.load(QSTART + sid)
    q_len = tl.load(QSTART + sid + 1) - q0
    if mt * BLOCK_M >= q_len:
        return
    seq_len = tl.load(LENS + sid)
    prefix = seq_len - q_len
    kvh = h // GROUP
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    d = tl.arange(0, HEAD_DIM_P)
    dmask = d < HEAD_DIM
    q = tl.load(Q + (q0 + rows)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    qpos = prefix + rows
    kv_end = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)  # the tile's last row sees no further
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        k, v = _load_kv_tile(K, V, KS, VS, KR, VR, SLOT, BT + sid.to(tl.int64) * stride_bt, n, nmask, d, dmask, kvh,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst,
                             stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_rb, stride_rt, stride_rh,
                             BLOCK_SIZE, DOT_F32, KV_INT8, KV_INT4)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        # Key 0 is visible to every row, so no row's maximum stays -inf after the first tile.
        scores = tl.where(nmask[None, :] & (n[None, :] <= qpos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        if MASS:
            _store_granule_lse(GLSE + h * stride_gh, q0 + rows, stride_gt, rmask, p, m_new, n0, num_granules,
                               BLOCK_M, BLOCK_N, GRANULE)
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m = m_new
    out = acc / lsum[:, None]
    tl.store(OUT + (q0 + rows)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    if MASS:
        tl.store(LSE + (q0 + rows).to(tl.int64) * stride_lt + h, m + tl.log(lsum), mask=rmask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_in_f32(dtype: torch.dtype) -> bool:
    """Triton's interpreter (3.9) computes bf16/fp16 ``tl.dot`` wrongly (garbage values), so
    under it the kernels upcast to float32 first; compiled kernels keep the pool's dtype."""
    return dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"


def _check_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged attention needs a contiguous last (head_dim) dimension")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not split into {k_cache.shape[2]} KV head groups")


def _pool_args(q: torch.Tensor, k_cache: torch.Tensor | Int8KV | Int4KV,
               v_cache: torch.Tensor | Int8KV | Int4KV) -> tuple[list, dict, tuple[int, int, int]]:
    """The kernels' pool arguments: ``(K, V, KS, VS, KR, VR, SLOT)`` pointers followed by their 15
    strides, the ``KV_INT8`` / ``KV_INT4`` constexprs, and the pool's (blocks, block_size,
    kv_heads). Float pools pass their own tensors as the (never read) scale and residual pointers
    and zero strides."""
    if type(k_cache) is not type(v_cache):
        raise ValueError("K and V pools must both be int8 or both float or both int4")
    int8, int4 = isinstance(k_cache, Int8KV), isinstance(k_cache, Int4KV)
    k, v = (k_cache.data, v_cache.data) if int8 else (k_cache.codes, v_cache.codes) if int4 else (k_cache, v_cache)
    _check_pool(q, k, v)
    kr, vr, slot, res_strides = k, v, k, [0] * 3
    if int8 or int4:
        ks, vs = k_cache.scale, v_cache.scale
        if ks.stride(-1) != 1 or vs.stride(-1) != 1:
            raise ValueError("KV scales need a contiguous last dimension")
        # int4 keys: [blocks, kv_heads, 2, d]; the second stride goes from a step row to its minimum row
        key_strides = [ks.stride(0), ks.stride(2), ks.stride(1)] if int4 else [ks.stride(0), ks.stride(1), ks.stride(2)]
        scale_strides = key_strides + [vs.stride(0), vs.stride(1), vs.stride(2)]
        if int4:
            kr, vr, slot = k_cache.residual, v_cache.residual, k_cache.state.slot_of
            res_strides = [kr.stride(0), kr.stride(1), kr.stride(2)]
    else:
        ks, vs = k, v
        scale_strides = [0] * 6
    args = [k, v, ks, vs, kr, vr, slot]
    strides = [k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), *scale_strides,
               *res_strides]
    return args + strides, {"KV_INT8": int8, "KV_INT4": int4}, tuple(k.shape[:3])


def plan_splits(max_len: int, num_programs: int, block_n: int = 64) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for a decode batch whose longest context is ``max_len``
    and which has ``num_programs`` (sequence, KV head) pairs: enough splits to fill the GPU,
    none shorter than ``MIN_SPLIT_TOKENS``; ``split_tokens`` is a multiple of ``block_n``.
    A fixed ``max_len`` (the model's context, as under CUDA graphs) gives a fixed plan."""
    by_length = max(1, math.ceil(max_len / MIN_SPLIT_TOKENS))
    by_occupancy = max(1, math.ceil(TARGET_PROGRAMS / max(num_programs, 1)))
    num_splits = min(by_length, by_occupancy)
    split_tokens = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
    return math.ceil(max_len / split_tokens), split_tokens


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Merge split outputs ``[B, H, S, d]`` (float32) with their log-sum-exp ``[B, H, S]``
    (``-inf`` for an empty split) -> ``[B, H, d]``: each split weighted by its share of the
    softmax denominator. Plain tensor ops, so it is graph-capturable."""
    top = lse.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)
    total = weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (partial * (weights / total).unsqueeze(-1)).sum(2)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor | Int8KV, v_cache: torch.Tensor | Int8KV,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_len: int,
                 num_splits: int | None = None, block_n: int = 64,
                 block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[B, H, d]`` (one token per sequence) -> ``[B, H, d]`` in q's dtype. The pools are
    float tensors of q's dtype or ``Int8KV`` (dequantized in the kernel, to q's dtype).

    ``block_table`` ``[B, W]`` int32 and ``seq_lens`` ``[B]`` int32 (every length >= 1 and
    <= ``max_len``). ``num_splits`` None plans them with :func:`plan_splits`.

    ``block_mass`` (H2O, float32 ``[B, >= W]``): each row's softmax mass per block of its table,
    summed over the heads, is added to it, from the probabilities the kernel weighs the values with
    (see :func:`_store_granule_lse`); the output is the same as without.
    """
    pool, flags, (num_blocks, block_size, kv_heads) = _pool_args(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    if num_splits is None:
        num_splits, split_tokens = plan_splits(max_len, batch * kv_heads, block_n)
    else:
        split_tokens = math.ceil(math.ceil(max_len / num_splits) / block_n) * block_n
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    mass = None if block_mass is None else _MassPartials(batch, num_heads, block_table.shape[1], block_size,
                                                         block_n, q.device)
    k, v, ks, vs, kr, vr, slot, *pool_strides = pool
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k, v, ks, vs, kr, vr, slot, block_table, seq_lens, partial, lse, scale,
        q.stride(0), q.stride(1), *pool_strides, block_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), split_tokens,
        *_MassPartials.launch_args(mass, dummy=lse),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        DOT_PREC=_dot_precision(q.dtype), DOT_F32=_dot_in_f32(q.dtype), **flags, **_MassPartials.flags(mass))
    if mass is not None and block_mass is not None:
        per_block = mass.per_block(torch.logsumexp(lse, -1))  # the row's lse over all its splits
        block_mass[:, :per_block.shape[1]] += per_block
    out = partial[:, :, 0] if num_splits == 1 else combine_splits(partial, lse)
    return out.to(q.dtype)


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor | Int8KV, v_cache: torch.Tensor | Int8KV,
                 block_table: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float, seq_offset: int, num_seqs: int, max_query_len: int, block_m: int = 64,
                 block_n: int = 64, block_mass: torch.Tensor | None = None) -> None:
    """Causal attention of sequences ``seq_offset .. seq_offset + num_seqs - 1`` of a varlen
    batch: q/out ``[T, H, d]`` (rows ``query_start[i]:query_start[i + 1]``), each sequence's
    ``seq_lens[i]`` keys read from the pool (the chunk's own keys already written there).
    Writes ``out`` rows of those sequences only.

    ``block_mass`` (H2O, float32 ``[all sequences, >= W]``, rows indexed like ``seq_lens``): row
    ``i`` of those sequences gets its chunk's softmax mass per block of its table added, summed
    over heads and query rows; the other rows are left as they are."""
    pool, flags, (_, block_size, kv_heads) = _pool_args(q, k_cache, v_cache)
    if num_seqs == 0:
        return
    num_tokens, num_heads, head_dim = q.shape
    mass = None if block_mass is None else _MassPartials(num_tokens, num_heads, block_table.shape[1], block_size,
                                                         block_n, q.device)
    # each row's final log-sum-exp; rows of other sequences stay 0, their granules -inf: no mass
    row_lse = out if mass is None else torch.zeros((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    k, v, ks, vs, kr, vr, slot, *pool_strides = pool
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _extend_kernel[grid](
        q, k, v, ks, vs, kr, vr, slot, block_table, query_start, seq_lens, out, scale, seq_offset,
        q.stride(0), q.stride(1), *pool_strides, block_table.stride(0), out.stride(0), out.stride(1),
        row_lse, row_lse.stride(0), *_MassPartials.launch_args(mass, dummy=out),
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=_dot_precision(q.dtype), DOT_F32=_dot_in_f32(q.dtype), **flags, **_MassPartials.flags(mass))
    if mass is not None and block_mass is not None:
        per_row = mass.per_block(row_lse)  # [T, W]
        # each row's sequence, on the device (no host sync): the first i with query_start[i + 1] > row
        rows = torch.arange(num_tokens, dtype=query_start.dtype, device=q.device)
        seq_of_row = torch.searchsorted(query_start[1:], rows, right=True)
        block_mass[:, :per_row.shape[1]].index_add_(0, seq_of_row.clamp_max(block_mass.shape[0] - 1), per_row)


class _MassPartials:
    """The partials of one launch's block-mass export: ``granule_lse`` ``[rows, heads, granules]``
    float32, the log-sum-exp of each ``granule`` keys' raw scores (-inf where no program wrote),
    with ``granule = min(block_n, block_size)`` (both powers of two, so granules tile the kernel's
    key tiles and the pool's blocks alike): ``rows x heads x width x block_size / granule``
    floats, one per (row, head, block) when a block holds at least ``block_n`` keys. Without the
    export (``None``) the kernels get a dummy pointer they never read and ``MASS=False``: the
    plain kernel, with no allocation (graph capture sees the launch it always saw)."""

    def __init__(self, rows: int, heads: int, width: int, block_size: int, block_n: int,
                 device: torch.device) -> None:
        if block_size & (block_size - 1) or block_n & (block_n - 1):
            raise ValueError(f"block-mass export needs power-of-two block_size and block_n, got {block_size} "
                             f"and {block_n}")
        self.granule = min(block_n, block_size)
        self.block_size = block_size
        self.granule_lse = torch.full((rows, heads, width * block_size // self.granule), float("-inf"),
                                      dtype=torch.float32, device=device)

    @staticmethod
    def launch_args(mass: _MassPartials | None, dummy: torch.Tensor) -> tuple:
        """``GLSE, stride_row, stride_head, num_granules`` of the kernels' signatures."""
        if mass is None:
            return dummy, 0, 0, 0
        g = mass.granule_lse
        return g, g.stride(0), g.stride(1), g.shape[2]

    @staticmethod
    def flags(mass: _MassPartials | None) -> dict[str, object]:
        return {"MASS": mass is not None, "GRANULE": 1 if mass is None else mass.granule}

    def per_block(self, row_lse: torch.Tensor) -> torch.Tensor:
        """``[rows, width]`` float32: each row's softmax mass per block summed over heads, given
        each (row, head)'s final log-sum-exp ``row_lse`` ``[rows, heads]``."""
        mass = torch.exp(self.granule_lse - row_lse.unsqueeze(-1)).sum(1)  # [rows, granules]
        return mass.view(mass.shape[0], -1, self.block_size // self.granule).sum(-1)
