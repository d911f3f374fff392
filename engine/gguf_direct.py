"""Load a GGUF for ``weights_resident: blocks``: its matrices stay GGUF blocks, nothing dense.

The dense route (``engine.loader.convert_gguf``) dequantizes the whole file to fp32 through
transformers once and loads that: 4-7x the file's size in memory and on disk, 28 GB for a
7B model. This route reads the file itself: every linear weight and the embedding table in
a ``BlockFormat`` is kept as blocks (``read_gguf_tensors``), the rest (norms, biases, any
matrix in another format) is dequantized by gguf's own ``dequantize``. Only the config and
tokenizer, which take transformers seconds to parse from the GGUF, are cached
(``<cache>/<stem>-<sha>-blocks/``). The kernels' values equal gguf's dequantization bit for
bit (tests/model/test_gguf_formats.py), so the model computes what transformers computes
from the same file, up to fp32 summation order.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from engine.arch import ModelArch
from engine.gguf_index import read_gguf_index
from engine.quant import GGUFMatrix, gguf_row_order, hf_name, read_block_matrix

logger = logging.getLogger(__name__)

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


def read_gguf_tensors(path: Path, arch: ModelArch) -> tuple[dict[str, GGUFMatrix], dict[str, torch.Tensor]]:
    """(blocks, dense): every matrix stored in a ``BlockFormat`` as blocks, everything else
    dequantized to fp32; transformers' names, llama's q/k row permutation undone."""
    import gguf

    index = read_gguf_index(path)
    blocks: dict[str, GGUFMatrix] = {}
    dense: dict[str, torch.Tensor] = {}
    # Plain file reads, not a memory map: mapped pages count in this process's RSS until
    # unmapped, and the copies are what stays.
    with open(path, "rb") as raw:
        for tensor in index.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                logger.info("GGUF tensor %s is not used", tensor.name)
                continue
            matrix = read_block_matrix(tensor, raw, index.architecture, arch)
            if matrix is not None:
                blocks[name] = matrix
                continue
            values = gguf.quants.dequantize(tensor.read(raw), gguf.GGMLQuantizationType(tensor.ggml_type))
            values = values.astype(np.float32, copy=False).reshape(tensor.shape[::-1])
            order = gguf_row_order(index.architecture, tensor.name, tensor.shape[-1], arch)  # a q/k bias's
            dense[name] = torch.from_numpy(np.array(values if order is None else values[order]))
    return blocks, dense


def gguf_config_dir(gguf_path: Path) -> Path:
    """A folder with the GGUF's config.json and tokenizer files (no weights), made once."""
    from engine.loader import _file_sha256, conversion_cache_dir, publish_dir

    target = conversion_cache_dir() / f"{gguf_path.stem}-{_file_sha256(gguf_path)[:16]}-blocks"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer

    logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path.name, target)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))

    return publish_dir(target, fill)

