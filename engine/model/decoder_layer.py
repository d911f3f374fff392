"""One Llama-family decoder layer in Python: the one definition, single rank and tensor parallel.

Weights are fused at load (q/k/v into one matrix, gate/up into another), so a layer is four
matmuls, bound by ``use_linear`` to the kernels in use (``engine.model.linear``,
``engine.model.block_linear``); under tensor parallelism o_proj and down are row-parallel and
all-reduce (``engine.model.parallel_linear``). The native decode path
(``engine.model.native_decode``) runs the same layer in C++ for all-decode steps.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.loader.gguf.blocks import BlockMatrix
from engine.model.arch import ModelArch
from engine.model.block_linear import BlockLinear
from engine.model.linear import dense_linear
from engine.model.parallel_linear import ModelShard
from engine.model.rope import apply_rope_signed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, native: bool) -> torch.Tensor:
    """F.rms_norm over the last dimension; ``native``: on the kernels' ``rms_norm`` (CPU, fp32)."""
    if native:
        return torch.ops.kvserve.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, shard: ModelShard | None = None) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.shard = shard  # tensor parallelism: this rank's heads and MLP columns (see parallel_linear)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h))
        self.qkv_bias: nn.Parameter | None = None
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.o_bias: nn.Parameter | None = None
        self.gate_up = nn.Parameter(torch.empty(2 * arch.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, arch.intermediate_size))
        self.blocks: dict[str, BlockMatrix] = {}  # weight name -> the same matrix as GGUF blocks
        self.blocks_only: set[str] = set()  # weights whose dense copy was dropped (weights_resident: blocks)
        # RMSNorm, the residual add before the second one and RoPE on the native kernels
        # (engine/kernels/cpu/prefill_rows.cpp: one pass each, the native decode layer's numerics)
        # instead of torch's composites; LlamaForCausalLM.select_linear_backend sets it
        self.native_rows = False
        self.use_linear("aten", use_blocks=False)

    # (matmul attribute, weight parameter, bias parameter) of the layer's four matmuls
    MATMULS = (("qkv_mm", "qkv", "qkv_bias"), ("o_mm", "o_proj", "o_bias"),
               ("gate_up_mm", "gate_up", None), ("down_mm", "down", None))
    # the matmuls whose partial sums are all-reduced under tensor parallelism
    ROW_PARALLEL = frozenset({"o_mm", "down_mm"})
    # weight parameter -> the HF modules (under ``model.layers.N.``) whose rows it stacks, in order
    FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}

    def use_linear(self, dense: str, use_blocks: bool, batch_hint: int = 16, int8_activations: bool = False) -> None:
        """Bind the four matmuls: ``dense`` (``aten`` or ``onednn``, see ``dense_linear``), each
        wrapped in a BlockLinear where ``use_blocks`` and the weight has blocks; a weight in
        ``blocks_only`` runs from its blocks alone whatever ``use_blocks`` says. With a shard,
        o_proj and down all-reduce their partial sums."""
        for attr, weight_name, bias_name in self.MATMULS:
            weight = getattr(self, weight_name)
            bias = getattr(self, bias_name) if bias_name else None
            mm: Callable[[torch.Tensor], torch.Tensor] | None = None
            if weight_name not in self.blocks_only:
                mm = dense_linear(weight, bias, dense, batch_hint)
            if (use_blocks or mm is None) and weight_name in self.blocks:
                mm = BlockLinear(self.blocks[weight_name], bias, mm, int8_activations)
            if self.shard is not None and attr in self.ROW_PARALLEL:
                mm = self.shard.row_parallel(mm)
            setattr(self, attr, mm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        """``cos`` and ``sin`` are ``[T, head_dim]``, ``sin`` the sign-adjusted table of
        :func:`engine.model.rope.signed_sin`.

        Each stage is a method that takes its input as a temporary, so a prefill chunk's
        intermediates (qkv, the normed rows, the MLP's ``[T, 2 * intermediate]``) are freed as
        soon as the stage ends rather than when this frame returns: the step's peak memory is
        one stage's, not the layer's sum."""
        h = self.o_mm(self._attention(rms_norm(x, self.input_norm, self.eps, self.native_rows), cos, sin, k_cache,
                                      v_cache, meta, attn))
        if self.native_rows:  # x + h written over h and its norm in one pass; the norm goes to the MLP as a temporary
            mlp = self._mlp(torch.ops.kvserve.add_rms_norm_(h, x.contiguous(), self.post_attn_norm, self.eps))
            return h + mlp
        x = x + h
        del h
        return x + self._mlp(rms_norm(x, self.post_attn_norm, self.eps, native=False))

    def _attention(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        t = y.shape[0]
        qkv = self.qkv_mm(y)
        del y
        # RoPE on q and k together: they are adjacent columns of qkv, so one view covers both.
        rotated = self.num_heads + self.num_kv_heads
        if self.native_rows:  # in place
            torch.ops.kvserve.rope_(qkv, cos, sin, rotated)
            qk = qkv[:, :self.q_size + self.kv_size].view(t, rotated, self.head_dim)
        else:
            qk = apply_rope_signed(qkv[:, :self.q_size + self.kv_size].view(t, rotated, self.head_dim),
                                   cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        return attn.forward(q, k, v, k_cache, v_cache, meta)

    def _mlp(self, y: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_mm.swiglu(y) if isinstance(self.gate_up_mm, BlockLinear) else None
        if h is None:
            gate, up = self.gate_up_mm(y).chunk(2, dim=-1)
            h = F.silu(gate).mul_(up)
            del gate, up  # the [T, 2 * intermediate] product goes before down_mm allocates
        del y
        return self.down_mm(h)
