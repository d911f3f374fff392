"""The GGUF files the peers run: what a file holds, and the all-F32 copy of the default model.

* ``gguf_weights()`` says what a GGUF file holds: its file type, the mix of tensor types
  (SmolLM2's 576-wide rows are not multiples of 256, so a "Q4_K_M" file is mostly Q5_0/Q8_0
  fallbacks) and the bytes one decode token reads (``decode_bytes``), the same rule as
  kvserve's ``decode_weight_bytes``; every row of a peer comparison states it.
* ``f32_gguf()`` writes the default model's weights as an all-F32 GGUF (every quantized tensor
  of the shipped Q4_1 file dequantized with ``gguf.quants.dequantize``, metadata copied), so
  that llama.cpp can run exactly the numbers kvserve and transformers run. Cached in the bench
  cache (``bench.peers.base.cache_dir``), keyed by the source's hash.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bench.peers.base import cache_dir, file_sha256


def decode_bytes(tensor_bytes: Mapping[str, int]) -> int:
    """Weight bytes one decode token reads from a llama-architecture GGUF, by tensor name:
    every tensor, except that the input embedding only has one row looked up, unless the
    file has no ``output.weight`` (tied embeddings), when ``token_embd`` is the LM head and
    is read in full. The same rule as kvserve's ``decode_weight_bytes``."""
    total = sum(tensor_bytes.values())
    if "output.weight" in tensor_bytes and "token_embd.weight" in tensor_bytes:
        total -= tensor_bytes["token_embd.weight"]
    return total


def type_mix(tensors: Iterable[tuple[str, int]]) -> list[tuple[str, float]]:
    """(tensor type, share of the bytes) pairs, largest share first, from (type, bytes) pairs."""
    by_type: dict[str, int] = {}
    for kind, nbytes in tensors:
        by_type[kind] = by_type.get(kind, 0) + nbytes
    total = sum(by_type.values()) or 1
    return sorted(((k, v / total) for k, v in by_type.items()), key=lambda kv: -kv[1])


def format_label(file_type: str, mix: Sequence[tuple[str, float]], min_share: float = 0.02) -> str:
    """``Q4_K_M GGUF (Q5_0 58%, Q8_0 26%, Q6_K 16%)``: the file type and the byte shares of
    the tensor types a decode token reads (types under ``min_share`` left out)."""
    parts = [f"{k} {share:.0%}" for k, share in mix if share >= min_share]
    return f"{file_type} GGUF ({', '.join(parts)})" if parts else f"{file_type} GGUF"


def gguf_weights(path: str | os.PathLike) -> dict[str, Any]:
    """File type, decode bytes per token and the tensor-type mix of a GGUF file (parsed once
    per file version: reading a GGUF's tokenizer fields takes seconds)."""
    st = Path(path).stat()
    return dict(_gguf_weights(str(Path(path).resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _gguf_weights(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path, "r")
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    ftype_field = reader.get_field(gguf.Keys.General.FILE_TYPE)
    file_type = "?"
    if ftype_field is not None:
        try:
            file_type = gguf.LlamaFileType(int(ftype_field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            file_type = str(ftype_field.contents())
    read = {n: b for n, b in sizes.items() if not (n == "token_embd.weight" and "output.weight" in sizes)}
    mix = type_mix((types[n], b) for n, b in read.items())
    return {"path": str(path), "file_type": file_type, "decode_bytes": decode_bytes(sizes),
            "file_bytes": Path(path).stat().st_size, "type_mix": [[k, round(s, 4)] for k, s in mix],
            "label": format_label(file_type, mix)}


def f32_gguf(source: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None) -> Path:
    """The all-F32 copy of ``source`` (default: the shipped SmolLM2 Q4_1 GGUF); written once."""
    if source is None:
        from engine.loader import default_gguf_path

        source = default_gguf_path()
    source = Path(source)
    out_dir = Path(out_dir) if out_dir else cache_dir()
    out = out_dir / f"{source.stem.replace('.Q4_1', '')}-F32-{file_sha256(source)[:12]}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    convert_to_f32(source, tmp)
    tmp.replace(out)
    return out


def convert_to_f32(source: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Copy every metadata KV pair and tensor of ``source`` into ``dest``, all tensors as F32."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field is not None else "llama"
    writer = gguf.GGUFWriter(dest, arch=arch)  # writes general.architecture itself
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE,
                                                            gguf.Keys.General.FILE_TYPE):
            continue  # header fields, re-derived by the writer; the file type changes below
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.asarray(tensor.data, dtype=np.float32)
        else:
            data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # numpy order is the reverse of GGUF's ne[] order; the writer reverses it back.
        data = data.reshape([int(d) for d in reversed(tensor.shape)])
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
