"""Paged attention: step metadata, one backend interface, and the registry of backends.

Token layout of a step (built by the ModelRunner): the single-token (decode) sequences come
first, one token each, then each prefill chunk's tokens contiguously. Every backend first
writes the step's new K/V into the paged pool through ``slot_mapping`` and only then
attends, so a sequence can attend to its own new tokens and to blocks another sequence of
the same step just filled (a prefix hit on a block computed in this step).

Backends: ``torch`` (SDPA reference, any device), ``native`` (compiled CPU decode kernel),
``triton`` (paged decode with split-K and paged prefill/extend), ``flash_attn`` (the
flash-attn package); ``auto`` picks per device (see ``base.AUTO_ORDER``).
"""
from engine.attention.base import (ATTENTION_BACKENDS, AUTO_ORDER, BACKENDS, AttentionBackend, check_backend_name,
                                   resolve_backend, select_attention)
from engine.attention.metadata import (AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk, gather_kv,
                                       write_kv)
# Importing the implementations registers them.
from engine.attention.torch_sdpa import TorchAttention
from engine.attention.native import NativeAttention
from engine.attention.triton_backend import TritonAttention
from engine.attention.flash_attn_backend import FlashAttention

__all__ = ["ATTENTION_BACKENDS", "AUTO_ORDER", "BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeGroup",
           "FlashAttention", "NativeAttention", "PagedLayout", "PrefillChunk", "TorchAttention", "TritonAttention",
           "check_backend_name", "gather_kv", "resolve_backend", "select_attention", "write_kv"]
