"""The tensor table of a GGUF file, read without materializing its metadata values.

gguf's own ``GGUFReader`` turns every metadata value into numpy arrays, the tokenizer's
vocabulary and merges (100-300K strings) included: ~157 MiB of RSS and seconds for a 1B
Llama's file, held while the weights load and freed only by a later garbage collection.
Loading weights needs the architecture's name, the data alignment and where each tensor
lies; ``read_gguf_index`` reads those and steps over every other value by its length.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; the metadata (key string, u32 value type, value); the tensor infos (name
string, u32 dims, u64 per dim in ggml order, u32 ggml type, u64 offset into the data);
then the data, starting at the next multiple of ``general.alignment`` (default 32).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

# Metadata value types (gguf.GGUFValueType) -> bytes per scalar; 8 = string, 9 = array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (the message says why)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: ``shape`` in ggml order (``shape[0]`` is a row's length, ``in_features``
    for a matrix), ``ggml_type`` a ``gguf.GGMLQuantizationType`` value, ``offset`` absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        import gguf

        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        if self.shape[0] % block_weights:
            raise GGUFFormatError(f"tensor {self.name}: a row of {self.shape[0]} is not whole blocks "
                                  f"of {block_weights}")
        return self.shape[0] // block_weights * block_bytes

    @property
    def n_bytes(self) -> int:
        return self.rows * self.row_bytes

    def read(self, file: BinaryIO) -> np.ndarray:
        """The tensor's bytes, uint8 ``[rows, row_bytes]``, read into a fresh array (no mapping)."""
        data = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        file.seek(self.offset)
        if file.readinto(memoryview(data).cast("B")) != data.nbytes:
            raise GGUFFormatError(f"tensor {self.name} runs past the end of the file")
        return data


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str  # general.architecture ("llama", "qwen2", ...), "" when absent
    tensors: tuple[GGUFTensorInfo, ...]


def read_gguf_index(path: str | Path) -> GGUFIndex:
    """The architecture and tensor table of ``path``; raises ``GGUFFormatError``."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Parser(buf).index()


class _Parser:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError("the header runs past the end of the file") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.take("Q")  # read before ``pos`` is: ``pos += take()`` would lose take's 8
            self.pos += length
        elif value_type == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip(item_type)
        elif value_type in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[value_type]
        else:
            raise GGUFFormatError(f"unknown metadata value type {value_type}")

    def index(self) -> GGUFIndex:
        if self.buf[:4] != b"GGUF":
            raise GGUFFormatError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self.take("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian "
                                  "file reads as a huge version)")
        n_tensors, n_kv = self.take("Q"), self.take("Q")
        architecture, alignment = "", 32
        for _ in range(n_kv):
            key, value_type = self.string(), self.take("I")
            if key == "general.architecture" and value_type == _STRING:
                architecture = self.string()
            elif key == "general.alignment" and value_type == _UINT32:
                alignment = self.take("I")
            else:
                self.skip(value_type)
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            shape = tuple(self.take("Q") for _ in range(self.take("I")))
            infos.append((name, shape, self.take("I"), self.take("Q")))
        data_start = -(-self.pos // alignment) * alignment
        tensors = tuple(GGUFTensorInfo(name, shape, ggml_type, data_start + offset)
                        for name, shape, ggml_type, offset in infos)
        for t in tensors:
            if t.offset + t.n_bytes > len(self.buf):
                raise GGUFFormatError(f"tensor {t.name} runs past the end of the file")
        return GGUFIndex(architecture, tensors)
