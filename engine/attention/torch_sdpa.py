"""``torch``: the reference backend on ``scaled_dot_product_attention``; any device, any dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register
from engine.attention.metadata import AttentionMetadata, DecodeGroup, gather_kv, write_kv


@register
class TorchAttention(AttentionBackend):
    """SDPA over contexts gathered from the pool (decode rows grouped by length by the runner).

    Subclasses replace ``_decode`` (the single-token rows) and keep the prefill path, which on
    CUDA runs PyTorch's own FlashAttention / memory-efficient kernels for fresh prompts.

    A float pool of another dtype than q's (``--kv-cache-dtype float16`` under a float32 model)
    is widened to q's dtype as it is gathered, and a fresh prompt attends to its own K/V rounded
    as the pool holds them, so a prompt gives the same numbers whether its prefix was cached or not.
    With ``prefill_dtype`` set (bf16, engine/attention/precision.py) prefill chunks round q, k and v
    to it before SDPA, cached prefix or not alike; decode rows and the block-mass path do not.
    """

    name = "torch"
    kv_cache_dtypes = ("auto", "int8", "float16", "int4")
    exports_block_mass = True  # with block_mass set, attends through explicit softmax (_attend_with_mass)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if isinstance(k_cache, torch.Tensor) and k_cache.dtype != q.dtype:  # what the pool holds
            # widened straight to the dtype the prefill chunks attend in (fp16 -> bf16: one copy);
            # the block-mass path attends in q's dtype
            wide = self.prefill_dtype if self.prefill_dtype and meta.block_mass is None else q.dtype
            k, v = k.to(k_cache.dtype).to(wide), v.to(v_cache.dtype).to(wide)
        num_tokens, num_heads, head_dim = q.shape
        groups = meta.decode_groups
        if meta.block_mass is not None:
            return self._forward_with_mass(q, k, v, k_cache, v_cache, meta).view(num_tokens, num_heads * head_dim)
        if len(groups) == 1 and not meta.prefills:  # the common pure-decode step: no scatter
            return self._decode(q, k_cache, v_cache, groups[0]).reshape(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        for g in groups:
            out[g.start:g.end] = self._decode(q[g.start:g.end], k_cache, v_cache, g)
        self._prefill(q, k, v, k_cache, v_cache, meta, out)
        return out.view(num_tokens, num_heads * head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        # q, k and v in the dtype the chunks attend in (prefill_dtype: bf16 for the AMX tiles);
        # the output returns to q's dtype as it is stored
        dtype = self.prefill_dtype or q.dtype
        for chunk in meta.prefills:
            # 4-D [1, H, q_len, d]: with a batch dimension CPU SDPA takes its flash kernel; 3-D
            # inputs with a mask fall back to the math path (bmm + softmax), 5x slower at 512 x 1000.
            q_c = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0).to(dtype)
            if chunk.block_ids is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0).to(dtype)
                values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0).to(dtype)
                o = F.scaled_dot_product_attention(q_c, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = gather_kv(k_cache, chunk.block_ids, 1, chunk.context_len).to(dtype)
                values = gather_kv(v_cache, chunk.block_ids, 1, chunk.context_len).to(dtype)
                if q.device.type == "cpu":
                    o = attend_after_prefix(q_c, keys, values, chunk.context_len - (chunk.end - chunk.start))
                else:
                    o = F.scaled_dot_product_attention(q_c, keys, values, attn_mask=chunk.mask, enable_gqa=True)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup) -> torch.Tensor:
        """Single-token rows in one call: q ``[B, H, d]`` against their contexts -> ``[B, H, d]``."""
        n = g.end - g.start
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), gather_kv(k_cache, g.block_ids, n, g.length).to(q.dtype),
            gather_kv(v_cache, g.block_ids, n, g.length).to(q.dtype),
            attn_mask=g.mask, enable_gqa=True).squeeze(2)

    def _forward_with_mass(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The same attention as ``forward`` through explicit softmax probabilities, whose mass
        per block goes into ``meta.block_mass`` on the way (one pass: the probabilities that
        weigh the values are the ones summed)."""
        mass = meta.block_mass
        assert mass is not None
        out = torch.empty_like(q)
        bs = k_cache.shape[1]
        for g in meta.decode_groups:
            out[g.start:g.end] = self._decode_with_mass(q[g.start:g.end], k_cache, v_cache, g, mass[g.start:g.end])
        num_decodes = meta.decode_groups[-1].end if meta.decode_groups else 0
        for j, chunk in enumerate(meta.prefills):
            q_c = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.block_ids is None:
                keys = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                values = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
                n = chunk.end - chunk.start
                causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            else:
                keys = gather_kv(k_cache, chunk.block_ids, 1, chunk.context_len).to(q.dtype)
                values = gather_kv(v_cache, chunk.block_ids, 1, chunk.context_len).to(q.dtype)
                causal = chunk.mask
            # query rows in slices: the probabilities are [heads, rows, context] floats
            for r in range(0, q_c.shape[2], MASS_QUERY_ROWS):
                rows = slice(r, r + MASS_QUERY_ROWS)
                o, m = _attend_with_mass(q_c[:, :, rows], keys, values, causal[rows], bs)
                out[chunk.start + r:chunk.start + r + o.shape[2]] = o[0].transpose(0, 1)
                mass[num_decodes + j, :m.shape[-1]] += m[0]
        return out

    def _decode_with_mass(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                          mass: torch.Tensor) -> torch.Tensor:
        """``_decode``, adding each row's probability mass per block of its table (over heads) to
        ``mass`` ``[B, >= blocks]`` (a view of the step's ``block_mass``)."""
        n = g.end - g.start
        keys = gather_kv(k_cache, g.block_ids, n, g.length).to(q.dtype)
        values = gather_kv(v_cache, g.block_ids, n, g.length).to(q.dtype)
        o, m = _attend_with_mass(q.unsqueeze(2), keys, values, g.mask, k_cache.shape[1])
        mass[:, :m.shape[-1]] += m
        return o.squeeze(2)

    def describe(self) -> str:
        return "torch SDPA"


MASS_QUERY_ROWS = 256  # a prefill chunk's rows per explicit-softmax call under block-mass export


def _attend_with_mass(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, H, Q, d]`` over keys/values ``[B, KVH, L, d]`` (grouped query heads), ``mask``
    broadcastable to ``[B, 1, Q, L]`` (True = may attend) -> (out ``[B, H, Q, d]``, the
    probability mass per block of ``block_size`` keys, summed over heads and query rows:
    ``[B, ceil(L / block_size)]`` float32)."""
    b, h, nq, d = q.shape
    kvh, length = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, kvh, h // kvh, nq, d)
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).float() * d ** -0.5  # [B, KVH, G, Q, L]
    if mask is not None:  # [Q, L] (a chunk) or [B, 1, 1, L] (decode rows) -> [B or 1, 1, 1, Q or 1, L]
        mask = mask[None, None, None] if mask.dim() == 2 else mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values.unsqueeze(2)).reshape(b, h, nq, d)
    per_key = probs.sum(dim=(1, 2, 3))  # [B, L]
    width = -(-length // block_size)
    per_key = F.pad(per_key, (0, width * block_size - length))
    return out.to(q.dtype), per_key.view(b, width, block_size).sum(-1)


def attend_after_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int) -> torch.Tensor:
    """A prefill chunk's attention on the CPU, ``PrefillChunk.mask``'s pattern without the mask:
    q ``[1, H, n, d]`` at positions ``prefix .. prefix + n - 1`` over keys / values
    ``[1, KVH, prefix + n, d]``: every prefix key is visible, the chunk's own keys causally.

    Two flash calls and a merge of their softmaxes by their log-sum-exps: the prefix with no mask,
    each kv head's G query heads stacked into one ``G n``-row query (one GEMM per kv head, no K/V
    copied per query head), then the chunk's own ``n`` keys, causal. Why: CPU SDPA reads a
    ``[n, prefix + n]`` mask per head and expands grouped K/V; this measured 21% less time at
    512 queries over 4,000 and 8,000 keys (9 heads of 64, 3 kv heads, 2 threads), and attention
    is most of a long prompt's prefill. Equal to the masked SDPA up to fp32 rounding (tested).
    q, keys and values share one dtype (float32, or bfloat16 for ``prefill_dtype``); the merge and
    the result are float32 (the prefix-free case returns the inputs' dtype)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, heads, n, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if prefix == 0:  # the flash kernel divides by zero over zero keys (SIGFPE): the causal call alone
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    stacked = q.reshape(1, kv_heads, group * n, d)
    o1, l1 = flash(stacked, keys[:, :, :prefix], values[:, :, :prefix])
    o1, l1 = o1.reshape(1, heads, n, d), l1.reshape(1, heads, n)
    own_k = keys[:, :, prefix:].repeat_interleave(group, dim=1)
    own_v = values[:, :, prefix:].repeat_interleave(group, dim=1)
    o2, l2 = flash(q, own_k, own_v, is_causal=True)
    top = torch.maximum(l1, l2)  # the log-sum-exps are fp32 whatever the inputs' dtype
    w1, w2 = (l1 - top).exp().unsqueeze(-1), (l2 - top).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
