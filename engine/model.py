"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights are fused at load (q/k/v into one matrix, gate/up into another) so a layer is five
matmuls. The forward takes a flat batch of tokens from many sequences (no padding) and
returns hidden states; ``compute_logits`` runs the LM head only on the rows that sample.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.arch import ModelArch
from engine.attention import AttentionMetadata, TorchAttention


def rope_cos_sin(hf_config: Any, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` for every supported RoPE variant.

    The inverse frequencies come from transformers' own RoPE initialisers (default, llama3,
    linear, yarn, ...), so scaled variants match the reference implementation exactly.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, d]``, cos/sin ``[T, 1, d]`` (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.q_size, self.kv_size = arch.num_heads * d, arch.num_kv_heads * d
        self.eps = arch.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h))
        self.qkv_bias: nn.Parameter | None = None
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size))
        self.o_bias: nn.Parameter | None = None
        self.gate_up = nn.Parameter(torch.empty(2 * arch.intermediate_size, h))
        self.down = nn.Parameter(torch.empty(h, arch.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn: TorchAttention) -> torch.Tensor:
        t = x.shape[0]
        y = F.rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        qkv = F.linear(y, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        x = x + F.linear(attn.forward(q, k, v, k_cache, v_cache, meta), self.o_proj, self.o_bias)
        y = F.rms_norm(x, (x.shape[-1],), self.post_attn_norm, self.eps)
        gate, up = F.linear(y, self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: Any, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = self.embed if arch.tie_word_embeddings else nn.Parameter(
            torch.empty(arch.vocab_size, arch.hidden_size))
        cos, sin = rope_cos_sin(hf_config, arch.head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attn = TorchAttention()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids/positions ``[T]`` -> final hidden states ``[T, hidden]``."""
        x = F.embedding(input_ids, self.embed)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta, self.attn)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights (``model.layers.N.self_attn.q_proj.weight``, ...) into the fused layout."""
        sd = dict(sd)
        take = sd.pop
        self.embed.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if self.arch.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        else:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_attn_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.qkv.copy_(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
            if a + "q_proj.bias" in sd:
                layer.qkv_bias = nn.Parameter(torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]))
            layer.o_proj.copy_(take(a + "o_proj.weight"))
            if a + "o_proj.bias" in sd:
                layer.o_bias = nn.Parameter(take(a + "o_proj.bias").clone())
            layer.gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.down.copy_(take(p + "mlp.down_proj.weight"))
        leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
