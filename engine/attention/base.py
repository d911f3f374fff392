"""The attention backend interface and the one registry of backend names.

Every backend name the engine accepts is a key of ``BACKENDS`` (plus ``auto``); the names
themselves are ``engine.config.ATTENTION_BACKENDS`` (a torch-free tuple: the config, the CLI and
the engine all validate against it), and ``register`` refuses a backend not listed there.
Backends are built through ``select_attention``, so a name or a refusal lives in one place.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import ATTENTION_BACKENDS, check_backend_name


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged pool, then attends.

    Contract of ``forward``: q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (the step's new
    tokens, in the runner's flat layout: decodes first, then prefill chunks), the pools
    ``[num_blocks, block_size, kv_heads, d]``; returns ``[T, heads * d]`` in q's dtype.
    """

    name: ClassVar[str]
    # Decode reads each row's own context length in place: the runner builds one decode
    # group (no grouping by length) and no padding mask.
    reads_lengths_in_place: ClassVar[bool] = False
    # The backend reads ``AttentionMetadata.paged`` (the runner builds it only then).
    uses_paged_layout: ClassVar[bool] = False
    # The forward is free of host synchronisation and data-dependent shapes for a pure
    # decode step, so it may be captured in a CUDA graph.
    graph_safe_decode: ClassVar[bool] = False
    # The ``--kv-cache-dtype`` pools the backend reads: ``auto`` (the model's dtype), ``int8``
    # (``engine.kv.int8.Int8KV``), ``float16`` (fp16 values under a model of another dtype).
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # The model's native decode path (engine/model/native_decode.py) may run under this backend:
    # its C++ layers attend with the same kernel, so both paths share the backend's numerics.
    supports_native_decode: ClassVar[bool] = False
    # The forward adds, for every query row and head, the softmax probability mass falling in
    # each block of the row's block table into ``AttentionMetadata.block_mass`` when the runner
    # sets it (H2O eviction, cache/eviction/h2o.py), from the probabilities it computes anyway.
    exports_block_mass: ClassVar[bool] = False
    # Why not, for the refusal at build (kv_eviction h2o with this backend).
    block_mass_refusal: ClassVar[str] = "its kernels do not export per-block attention mass"
    # The dtype prefill chunks attend in where it is not the model's (None: the model's): set by
    # the builder from ModelConfig.prefill_attention_dtype (engine/attention/precision.py), which
    # only sets it on the CPU, where every backend is a TorchAttention.
    prefill_dtype: torch.dtype | None = None

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        """None when the backend can run with these settings, else the reason it cannot."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ...

    def describe(self) -> str:
        """One phrase for the startup log."""
        return self.name

    def prefill_kernel(self, head_dim: int) -> str:
        """What multiplies the CPU's prefill chunks (in ``prefill_dtype``, else the model's dtype) at
        this head size, for the startup log."""
        return "torch SDPA"

    def prefill_on_tiles(self, head_dim: int) -> bool:
        """Whether the CPU's prefill chunks multiply on AMX tiles at this head size (kvserve's own
        bf16 kernel): what makes a chunk of many rows cheaper in ``forward`` than as rows of the
        native decode path (engine/model/native_decode.py ``NativeDecoder.chunks_fit``)."""
        return False


BACKENDS: dict[str, type[AttentionBackend]] = {}
# What ``auto`` tries, in order, per device type; the first available one wins.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("flash_attn", "triton", "torch"), "cpu": ("native", "torch")}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    if cls.name not in ATTENTION_BACKENDS:
        raise ValueError(f"backend {cls.name!r} must be listed in ATTENTION_BACKENDS")
    BACKENDS[cls.name] = cls
    return cls


def kv_dtype_backends(kv_cache_dtype: str) -> list[str]:
    """The backends that read ``kv_cache_dtype`` pools, in registry order."""
    return [name for name, cls in BACKENDS.items() if kv_cache_dtype in cls.kv_cache_dtypes]


def _unavailable(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                 kv_cache_dtype: str) -> str | None:
    why = BACKENDS[name].unavailable(device, dtype, block_size)
    if why is None and kv_cache_dtype not in BACKENDS[name].kv_cache_dtypes:
        why = (f"its kernels do not read {kv_cache_dtype} KV pools; kv_cache_dtype {kv_cache_dtype} runs on "
               f"{', '.join(kv_dtype_backends(kv_cache_dtype))}")
    return why


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                    kv_cache_dtype: str = "auto") -> str:
    """The concrete backend ``name`` stands for on this device with this KV dtype; ValueError
    with the reason when an explicitly named backend cannot run here (``auto`` skips the ones
    that cannot, e.g. flash-attn for an int8 pool, and takes the next in ``AUTO_ORDER``).
    ``kv_cache_dtype`` is the engine's, with ``float16`` under a float16 model already made ``auto``."""
    check_backend_name(name)
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER.get(device.type, ("torch",)):
            why = _unavailable(candidate, device, dtype, block_size, kv_cache_dtype)
            if why is None:
                return candidate
            reasons.append(f"{candidate}: {why}")
        raise ValueError("no attention backend can run here: " + "; ".join(reasons))
    why = _unavailable(name, device, dtype, block_size, kv_cache_dtype)
    if why is not None:
        kv = f" with a{'n' if kv_cache_dtype == 'int8' else ''} {kv_cache_dtype} KV pool" if kv_cache_dtype != "auto" else ""
        raise ValueError(f"attention_backend {name!r} cannot run on {device.type} in {str(dtype).removeprefix('torch.')}"
                         f" with block_size {block_size}{kv}: {why}")
    return name


def select_attention(name: str, device: torch.device, dtype: torch.dtype, block_size: int = 16,
                     kv_cache_dtype: str = "auto") -> AttentionBackend:
    """Build the backend for ``ModelConfig.attention_backend`` (see ``resolve_backend``)."""
    return BACKENDS[resolve_backend(name, device, dtype, block_size, kv_cache_dtype)]()
