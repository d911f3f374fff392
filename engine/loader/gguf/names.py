"""llama.cpp's tensor names and row order -> transformers': the one name map of the GGUF loader."""
from __future__ import annotations

import numpy as np

from engine.model.arch import ModelArch

# llama.cpp's tensor names for a Llama-family layer -> transformers' names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for tensors
    that are not linear weights (norms, ...)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for rotary embeddings (the inverse
    transformers applies when it reads a llama GGUF): new row i is old row ``index[i]``."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def gguf_row_order(gguf_arch: str, tensor_name: str, rows: int, arch: ModelArch) -> np.ndarray | None:
    """The row order that gives transformers' q/k matrix (and bias) from a llama GGUF's, else None."""
    if gguf_arch != "llama" or not (".attn_q." in tensor_name or ".attn_k." in tensor_name):
        return None
    return unpermute_rows(rows, arch.num_heads if ".attn_q." in tensor_name else arch.num_kv_heads)


# GGUF names of the non-matrix tensors of a layer -> transformers' names under model.layers.N.
_LAYER_VECTORS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                  "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                  "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias"}


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name of any tensor of a Llama-family GGUF; None for ones it does not use
    (``rope_freqs``: transformers recomputes RoPE from the config)."""
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    matrix = hf_name(gguf_name)
    if matrix is not None:
        return matrix
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_VECTORS:
        return f"model.layers.{parts[1]}.{_LAYER_VECTORS[parts[2]]}"
    return None
