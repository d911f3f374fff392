"""Load a GGUF for ``weights_resident: blocks``: its matrices stay GGUF blocks, nothing dense.

The dense route (``engine.loader.checkpoint.convert_gguf``) dequantizes the whole file to fp32 through
transformers once and loads that: 4-7x the file's size in memory and on disk, 28 GB for a
7B model. This route reads the file itself: every linear weight and the embedding table in
a ``BlockFormat`` is kept as blocks (``read_gguf_tensors``), the rest (norms, biases, any
matrix in another format) is dequantized by gguf's own ``dequantize``. Only the config and
tokenizer, which take transformers seconds to parse from the GGUF, are cached
(``<cache>/<stem>-<sha>-blocks/``). The kernels' values equal gguf's dequantization bit for
bit (tests/engine/loader/test_gguf_formats.py), so the model computes what transformers computes
from the same file, up to fp32 summation order.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from engine.model.arch import ModelArch
from engine.paths import conversion_cache_dir, file_sha256, publish_dir
from engine.loader.gguf.reader import read_gguf_index
from engine.loader.gguf.blocks import BlockFormat, GGUFMatrix
from engine.loader.gguf.names import gguf_row_order, hf_name, hf_tensor_name
from engine.loader.gguf.reader import GGUFTensorInfo

logger = logging.getLogger(__name__)

def read_gguf_tensors(path: Path, arch: ModelArch, with_dense: bool = True,
                      ) -> tuple[dict[str, GGUFMatrix], dict[str, torch.Tensor]]:
    """(blocks, dense): every matrix stored in a ``BlockFormat`` as blocks, everything else
    dequantized to fp32 (left out with ``with_dense=False``); transformers' names, llama's q/k row
    permutation undone. The one walk over a GGUF's tensors: ``read_gguf_blocks`` is its first half."""
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
            if not with_dense:
                continue
            values = gguf.quants.dequantize(tensor.read(raw), gguf.GGMLQuantizationType(tensor.ggml_type))
            values = values.astype(np.float32, copy=False).reshape(tensor.shape[::-1])
            order = gguf_row_order(index.architecture, tensor.name, tensor.shape[-1], arch)  # a q/k bias's
            dense[name] = torch.from_numpy(np.array(values if order is None else values[order]))
    return blocks, dense


def gguf_config_dir(gguf_path: Path) -> Path:
    """A folder with the GGUF's config.json and tokenizer files (no weights), made once."""
    target = conversion_cache_dir() / f"{gguf_path.stem}-{file_sha256(gguf_path)[:16]}-blocks"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer

    logger.info("reading the config and tokenizer of %s into %s (once)", gguf_path.name, target)
    # a local file (hashed above): never a Hub download (bandit B615 asks for a pinned revision)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,  # nosec B615
                                        local_files_only=True).to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,  # nosec B615
                                              local_files_only=True)

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))

    return publish_dir(target, fill)


def read_block_matrix(tensor: GGUFTensorInfo, raw: BinaryIO, gguf_arch: str, arch: ModelArch) -> GGUFMatrix | None:
    """``tensor`` (of the GGUF open as ``raw``) as blocks when it is a linear weight stored in a
    ``BlockFormat``, q/k rows in transformers' order; None otherwise, having read nothing."""
    fmt = BlockFormat.from_ggml(tensor.ggml_type) if hf_name(tensor.name) is not None else None
    if fmt is None or tensor.shape[0] % fmt.block_weights:  # F16 / BF16 rows the kernel cannot cut in 32s
        return None
    data = tensor.read(raw)  # [rows, row bytes]
    order = gguf_row_order(gguf_arch, tensor.name, tensor.shape[-1], arch)
    return GGUFMatrix(torch.from_numpy(data if order is None else data[order]), fmt, tensor.shape[0])


def read_gguf_blocks(path: Path, arch: ModelArch) -> dict[str, GGUFMatrix]:
    """The linear weights of a GGUF file stored in a ``BlockFormat`` (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) under transformers' names; matrices in other formats (F32,
    Q2_K, Q3_K, IQ*, ...) are left out and run dense."""
    return read_gguf_tensors(path, arch, with_dense=False)[0]
