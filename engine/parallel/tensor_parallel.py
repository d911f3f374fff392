"""Tensor parallelism for the Llama family over torch.distributed, one process per rank.

The split (Megatron-style), for ``N`` ranks, rank ``r``:

- attention: q/k/v are column-parallel by heads. Rank ``r`` holds query heads
  ``[r*H/N, (r+1)*H/N)`` and the KV heads they read, ``[r*KV/N, (r+1)*KV/N)`` (GQA groups
  stay whole). ``o_proj`` is row-parallel: partial sums, then one all-reduce; its bias is
  added by rank 0 only.
- MLP: gate/up column-parallel, down row-parallel, then one all-reduce.
- embedding: vocab-parallel. Each rank looks up the ids in its slice of ``ceil(V/N)`` rows
  (zeros elsewhere), then an all-reduce.
- LM head: vocab-parallel. Each rank computes its slice of the logits, then an all-gather
  (zero rows pad the last slice; the padding is cut off).
- KV pool: each rank allocates ``[num_blocks, block_size, KV/N, head_dim]`` per layer, its own
  heads only, with the block ids rank 0's cache manager hands out.

Rank 0 is the engine process: scheduler, KV cache manager and sampler run there only. Its
model is a :class:`TensorParallelModel`, which broadcasts each step's inputs (token ids,
positions, attention metadata: slot mapping and block tables) to ranks 1..N-1 before running
its own shard. Those ranks (:func:`_worker`, spawned processes) run the same forward on
theirs, so prefix caching and preemption need nothing on the workers: they only ever see
block ids. The collectives run on a process group of the engine's own (``comm.Group``):
gloo on CPU tensors. NCCL on GPU is not wired yet, and ``device: cuda`` with more than one
rank is refused.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import threading
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from engine.arch import ModelArch
from engine.attention import AttentionMetadata, select_attention
from engine.model import LlamaForCausalLM, apply_rope_signed
from engine.parallel.comm import Group

logger = logging.getLogger(__name__)


# ---- sharding ---------------------------------------------------------------------------------
def shard_arch(arch: ModelArch, world: int) -> ModelArch:
    """The per-rank architecture: H/N query heads, KV/N KV heads, I/N MLP width, ceil(V/N) vocab rows."""
    for name, value in (("attention heads", arch.num_heads), ("KV heads", arch.num_kv_heads),
                        ("intermediate size", arch.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the model's {name} ({value})")
    return dataclasses.replace(arch, num_heads=arch.num_heads // world, num_kv_heads=arch.num_kv_heads // world,
                               intermediate_size=arch.intermediate_size // world,
                               vocab_size=math.ceil(arch.vocab_size / world))


def shard_state_dict(sd: dict[str, torch.Tensor], arch: ModelArch, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of an HF-named state dict (see the module docstring for the split)."""
    d = arch.head_dim
    q, kv = arch.num_heads // world * d, arch.num_kv_heads // world * d
    inter = arch.intermediate_size // world
    vocab = math.ceil(arch.vocab_size / world)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            t = t[rank * q:(rank + 1) * q]
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            t = t[rank * kv:(rank + 1) * kv]
        elif name.endswith("o_proj.weight"):
            t = t[:, rank * q:(rank + 1) * q]
        elif name.endswith("o_proj.bias"):
            t = t if rank == 0 else torch.zeros_like(t)  # added once, after the all-reduce sums
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = t[rank * inter:(rank + 1) * inter]
        elif name.endswith("down_proj.weight"):
            t = t[:, rank * inter:(rank + 1) * inter]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = t[rank * vocab:(rank + 1) * vocab]
            if rows.shape[0] < vocab:
                rows = torch.cat([rows, rows.new_zeros(vocab - rows.shape[0], t.shape[1])])
            t = rows
        out[name] = t.contiguous().clone()
    return out


# ---- the forward pass of one rank -------------------------------------------------------------
@torch.inference_mode()
def tp_forward(model: LlamaForCausalLM, group: Group, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``LlamaForCausalLM.forward`` on a shard, with the all-reduces of the row-parallel matmuls."""
    vocab = model.arch.vocab_size
    local = input_ids - group.rank * vocab
    inside = (local >= 0) & (local < vocab)
    x = F.embedding(local.clamp(0, vocab - 1), model.embed) * inside.unsqueeze(1).to(model.embed.dtype)
    group.all_reduce(x)
    cos = model.rope_cos[positions].unsqueeze(1)
    sin = model.rope_sin_signed[positions].unsqueeze(1)
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        t = x.shape[0]
        y = F.rms_norm(x, (x.shape[-1],), layer.input_norm, layer.eps)
        qkv = layer.qkv_mm(y)
        qk = apply_rope_signed(qkv[:, :layer.q_size + layer.kv_size].view(t, layer.num_heads + layer.num_kv_heads,
                                                                            layer.head_dim), cos, sin)
        q, k = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
        v = qkv[:, layer.q_size + layer.kv_size:].view(t, layer.num_kv_heads, layer.head_dim)
        x = x + group.all_reduce(layer.o_mm(model.attn.forward(q, k, v, k_cache, v_cache, meta)))
        y = F.rms_norm(x, (x.shape[-1],), layer.post_attn_norm, layer.eps)
        gate, up = layer.gate_up_mm(y).chunk(2, dim=-1)
        x = x + group.all_reduce(layer.down_mm(F.silu(gate).mul_(up)))
    return F.rms_norm(x, (x.shape[-1],), model.norm, model.arch.rms_norm_eps)


@torch.inference_mode()
def tp_logits(model: LlamaForCausalLM, group: Group, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return group.all_gather_cat(model.compute_logits(hidden), dim=-1)[:, :vocab_size]


def build_shard(arch: ModelArch, hf_config: Any, max_len: int, shard_sd: dict[str, torch.Tensor],
                attention_backend: str, linear_backend: str, dtype: torch.dtype) -> LlamaForCausalLM:
    model = LlamaForCausalLM(arch, hf_config, max_len).to(dtype)
    model.attn = select_attention(attention_backend, torch.device("cpu"), dtype)
    model.load_hf_state_dict(shard_sd)
    model.eval()
    model.select_linear_backend(linear_backend)
    return model


# ---- the other ranks ----------------------------------------------------------------------------
def _exit_with_parent(parent: int) -> None:
    """A worker must not outlive the engine (a SIGKILLed engine leaves no one to stop it)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(1.0)


def _worker(rank: int, world: int, port: int, arch: ModelArch, hf_config: Any, max_len: int,
            shard_sd: dict[str, torch.Tensor], attention_backend: str, linear_backend: str, dtype: torch.dtype,
            num_threads: int, vocab_size: int, parent: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(num_threads)
    model = build_shard(arch, hf_config, max_len, shard_sd, attention_backend, linear_backend, dtype)
    group = Group.create(rank, world, port).connect()
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    while True:
        try:
            msg = group.broadcast_object()
        except RuntimeError:  # rank 0 is gone (its process exited or died): so is the engine
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "forward":
            _, input_ids, positions, meta, kv_shape = msg
            if not kv_caches:
                kv_caches = [(torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype))
                             for _ in range(arch.num_layers)]
            tp_forward(model, group, input_ids, positions, meta, kv_caches)
        elif kind == "logits":
            tp_logits(model, group, msg[1], vocab_size)


# ---- rank 0 -------------------------------------------------------------------------------------
class TensorParallelModel:
    """Rank 0's model, as the ModelRunner sees it: ``arch`` (the per-rank numbers, so the
    runner's KV pool holds this rank's heads), ``attn``, ``__call__`` and ``compute_logits``."""

    def __init__(self, shard: LlamaForCausalLM, group: Group, vocab_size: int, procs: list) -> None:
        self.shard = shard
        self.arch = shard.arch
        self.attn = shard.attn
        self.group = group
        self.vocab_size = vocab_size
        self.procs = procs
        self.linear_backend = shard.linear_backend
        self._closed = False

    @classmethod
    def launch(cls, arch: ModelArch, hf_config: Any, state_dict: dict[str, torch.Tensor], world: int, max_len: int,
               attention_backend: str, linear_backend: str, dtype: torch.dtype, num_threads: int,
               device: torch.device) -> "TensorParallelModel":
        """Shard ``state_dict``, spawn ranks 1..world-1, build rank 0's shard, connect the group."""
        if device.type != "cpu":
            raise ValueError("tensor_parallel_size > 1 runs on CPU (gloo) only for now; NCCL on GPU is not wired")
        if linear_backend == "gguf":
            raise ValueError("linear_backend 'gguf' does not shard; use 'auto', 'onednn' or 'aten' with "
                             "tensor_parallel_size > 1")
        local = shard_arch(arch, world)
        linear = "aten" if linear_backend == "aten" else "onednn"
        group = Group.create(0, world)
        ctx = mp.get_context("spawn")
        procs = []
        for rank in range(1, world):
            p = ctx.Process(target=_worker, name=f"kvserve-tp{rank}", daemon=True,
                            args=(rank, world, group.port, local, hf_config, max_len,
                                  shard_state_dict(state_dict, arch, rank, world), attention_backend, linear, dtype,
                                  num_threads, arch.vocab_size, os.getpid()))
            p.start()
            procs.append(p)
        shard = build_shard(local, hf_config, max_len, shard_state_dict(state_dict, arch, 0, world),
                            attention_backend, linear, dtype)
        group.connect()
        logger.info("Tensor parallel: %d ranks over gloo (this process is rank 0; %d query heads, %d KV heads "
                    "and %d vocabulary rows per rank)", world, local.num_heads, local.num_kv_heads, local.vocab_size)
        model = cls(shard, group, arch.vocab_size, procs)
        ref = weakref.ref(model)
        atexit.register(lambda: (m := ref()) is not None and m.close())  # stop the workers cleanly
        return model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self.group.broadcast_object(("forward", input_ids, positions, meta, tuple(kv_caches[0][0].shape)))
        return tp_forward(self.shard, self.group, input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.broadcast_object(("logits", hidden))
        return tp_logits(self.shard, self.group, hidden, self.vocab_size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.group.broadcast_object(("stop",))
        except Exception:  # noqa: BLE001 - a dead worker: nothing to stop
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
