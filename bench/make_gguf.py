"""Write Llama-family GGUF files from random blocks: tiny ones for tests, a 1B-shaped Q4_K_M for benches.

gguf-py cannot quantize the K formats, but any block whose fp16 scales are finite is a valid
block, so random bytes with small random scales make a valid matrix in every format (what
it decodes to is whatever gguf's own ``dequantize`` says). The tokenizer is the shipped
SmolLM2 GGUF's (optionally cut to its first ``vocab`` tokens and the merges among them), so
transformers, kvserve and llama-server can all read the result.

    python -m bench.make_gguf                     # the 1B-shaped Q4_K_M into the bench cache
    python -m bench.make_gguf --out x.gguf --layers 4

The 1B shape (``ONE_B``): hidden 2048, 16 layers, 32 heads, 8 KV heads (head_dim 64), FFN
8192, vocab 49152 (SmolLM2's tokenizer), untied LM head: 1.17 B weights, ~0.7 GB as Q4_K_M.
Q4_K_M as llama-quantize lays it out: Q4_K everywhere except the LM head and, in the layers
``use_more_bits`` picks, attn_v and ffn_down, which are Q6_K.
"""
from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from engine.loader.gguf.blocks import BlockFormat

# byte offsets of each format's fp16 scales inside a block (d, then dmin/m where present)
SCALE_OFFSETS = {BlockFormat.Q4_0: (0,), BlockFormat.Q4_1: (0, 2), BlockFormat.Q8_0: (0,),
                 BlockFormat.Q4_K: (0, 2), BlockFormat.Q5_K: (0, 2), BlockFormat.Q6_K: (208,),
                 BlockFormat.Q5_0: (0,), BlockFormat.Q5_1: (0, 2)}
# scale of d for weights with a standard deviation of roughly 0.02 (codes and sub-scales uniform)
_D_SCALE = {BlockFormat.Q4_0: 4e-3, BlockFormat.Q4_1: 4e-3, BlockFormat.Q8_0: 3e-4, BlockFormat.Q4_K: 1.4e-4,
            BlockFormat.Q5_K: 7e-5, BlockFormat.Q6_K: 1.5e-5, BlockFormat.Q5_0: 2e-3, BlockFormat.Q5_1: 2e-3}


def random_blocks(fmt: BlockFormat, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, cols / block_weights * block_bytes]``: random codes and sub-scales, finite
    random fp16 scales (the min term of Q4_1/Q4_K/Q5_K sized to centre the weights near zero);
    for F16 / BF16 random normal halves."""
    if fmt in (BlockFormat.F16, BlockFormat.BF16):  # plain halves, standard deviation ~0.02
        values = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        halves = values.astype(np.float16).view(np.uint16) if fmt == BlockFormat.F16 else values.view(np.uint32) >> 16
        return np.ascontiguousarray(halves.astype(np.uint16)).view(np.uint8).reshape(rows, cols * 2)
    nb = cols // fmt.block_weights
    raw = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    d = np.abs(rng.standard_normal((rows, nb, 1))).astype(np.float32) * _D_SCALE[fmt] + _D_SCALE[fmt] / 4
    offs = SCALE_OFFSETS[fmt]
    raw[:, :, offs[0]:offs[0] + 2] = d.astype(np.float16).view(np.uint8)
    if len(offs) > 1:  # Q4_1/Q5_1: m (added), K formats: dmin (subtracted)
        m = {BlockFormat.Q4_1: -7.5, BlockFormat.Q5_1: -15.5, BlockFormat.Q4_K: 7.5}.get(fmt, 15.5) * d
        raw[:, :, offs[1]:offs[1] + 2] = m.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, nb * fmt.block_bytes)


@dataclass(frozen=True)
class GGUFShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 49152
    tie: bool = False
    arch: str = "llama"  # or "qwen2" (q/k/v biases, no q/k row permutation)
    context: int = 4096
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


ONE_B = GGUFShape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v/ffn_down get more bits in *_M files."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(name: str, layer: int | None, layers: int) -> BlockFormat:
    if name == "output":
        return BlockFormat.Q6_K
    if name in ("attn_v", "ffn_down") and layer is not None and use_more_bits(layer, layers):
        return BlockFormat.Q6_K
    return BlockFormat.Q4_K


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(vocab: int) -> tuple[tuple[str, object, object, object], ...]:
    """The shipped GGUF's tokenizer.* fields, cut to the first ``vocab`` tokens."""
    import gguf

    from engine.loader import default_gguf_path

    template = gguf.GGUFReader(default_gguf_path())
    fields = []
    tokens = None
    for field in template.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = tokens = value[:vocab]
        elif field.name == "tokenizer.ggml.token_type":
            value = value[:vocab]
        fields.append((field.name, value, vtype, sub))
    known = set(tokens or [])
    out: list[tuple[str, object, object, object]] = []
    for name, value, vtype, sub in fields:
        if name == "tokenizer.ggml.merges":
            value = [m for m in value if (lambda a, b: a in known and b in known and a + b in known)(*m.split(" ", 1))]
        elif name.endswith("_token_id") and isinstance(value, int) and value >= vocab:
            continue
        out.append((name, value, vtype, sub))
    return tuple(out)


def write_gguf(path: str | os.PathLike, shape: GGUFShape,
               formats: Callable[[str, int | None, int], BlockFormat | None], seed: int = 0) -> Path:
    """A random-weight Llama-family GGUF: every matrix in ``formats(name, layer, layers)`` (None:
    F32 random normal), norms near 1, qwen2 biases F32. Written through a temporary name."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    s = shape
    writer = gguf.GGUFWriter(str(path) + ".tmp", arch=s.arch)
    for name, value, vtype, sub in _tokenizer_fields(s.vocab):
        writer.add_key_value(name, value, vtype, sub_type=sub)
    writer.add_name(f"random-{s.arch}-{s.hidden}x{s.layers}")
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_vocab_size(s.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    def matrix(name: str, layer: int | None, rows: int, cols: int) -> None:
        fmt = formats(name, layer, s.layers)
        full = name if layer is None else f"blk.{layer}.{name}"
        if fmt is None:
            writer.add_tensor(full + ".weight", (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
        else:
            writer.add_tensor(full + ".weight", random_blocks(fmt, rows, cols, rng), raw_dtype=fmt.ggml_type)

    def vector(name: str, n: int, around: float, spread: float) -> None:
        writer.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    hd = s.head_dim
    matrix("token_embd", None, s.vocab, s.hidden)
    vector("output_norm.weight", s.hidden, 1.0, 0.1)
    if not s.tie:
        matrix("output", None, s.vocab, s.hidden)
    for i in range(s.layers):
        vector(f"blk.{i}.attn_norm.weight", s.hidden, 1.0, 0.1)
        vector(f"blk.{i}.ffn_norm.weight", s.hidden, 1.0, 0.1)
        for name, rows, cols in (("attn_q", s.heads * hd, s.hidden), ("attn_k", s.kv_heads * hd, s.hidden),
                                 ("attn_v", s.kv_heads * hd, s.hidden), ("attn_output", s.hidden, s.heads * hd),
                                 ("ffn_gate", s.ffn, s.hidden), ("ffn_up", s.ffn, s.hidden),
                                 ("ffn_down", s.hidden, s.ffn)):
            matrix(name, i, rows, cols)
        if s.arch == "qwen2":
            for name, n in (("attn_q", s.heads * hd), ("attn_k", s.kv_heads * hd), ("attn_v", s.kv_heads * hd)):
                vector(f"blk.{i}.{name}.bias", n, 0.0, 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".tmp", path)
    return path


def one_b_q4_k_m(out: str | os.PathLike | None = None, layers: int | None = None) -> Path:
    """The 1B-shaped random Q4_K_M GGUF (``ONE_B``), written once into the bench cache."""
    from bench.peers.base import cache_dir

    shape = ONE_B if layers is None else replace(ONE_B, layers=layers)
    path = Path(out) if out else cache_dir() / f"random-1b-{shape.layers}l-Q4_K_M.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(path, shape, q4_k_m)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output path (default: the bench cache)")
    parser.add_argument("--layers", type=int, help=f"layers (default {ONE_B.layers})")
    args = parser.parse_args(argv)
    path = one_b_q4_k_m(args.out, args.layers)
    print(f"{path} ({path.stat().st_size / 1e9:.2f} GB)")
    return path


if __name__ == "__main__":
    main()
