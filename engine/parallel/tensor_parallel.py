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
  heads only, with the block ids rank 0's cache manager hands out, in rank 0's layout (float,
  or ``Int8KV`` codes plus per-token-per-head scales for ``--kv-cache-dtype int8``: the
  quantization is per head, so a rank's share of the pool is exactly its heads' share).
- KV tiers: a tier payload holds every head in the single-rank layout; rank 0 gathers the other
  ranks' head slices to offload blocks and scatters each rank its heads of restored ones
  (``block_copy.py``).

Every rank's model is a ``LlamaForCausalLM`` built with a ``ModelShard``
(engine/model/parallel_linear.py): the same decoder layer as one rank's, its o_proj and down
all-reducing, its embedding and LM head vocab-parallel. Rank 0 is the engine process:
scheduler, KV cache manager and sampler run there only. Its model's ``ranks`` is a
:class:`TensorParallelRanks`, which broadcasts each step's inputs (token ids, positions,
attention metadata: slot mapping and block tables) to ranks 1..N-1 before the model runs its
own shard. Those ranks (:func:`_worker`, spawned processes) run the same forward on theirs, so
prefix caching and preemption need nothing on the workers: they only ever see block ids. The
collectives run on process groups of the engine's own (``comm.Group``): gloo on the CPU; on
CUDA, NCCL for the model's all-reduces and all-gathers with rank ``r`` on ``cuda:r``, plus a
gloo group for the step broadcasts. CUDA graphs are off with more than one rank (each step
starts with a host-side broadcast that a graph replay would skip).

Processes: in the served (process) mode the engine core process is rank 0 and spawns the
other ranks. They die with it (``_die_with_parent``: the kernel's parent-death signal, and a
``getppid`` poll), so a killed core leaves no orphan; a rank that dies makes the core exit
(``LlamaForCausalLM.watch_ranks``, installed by ``engine.core.loop.run_core_process``), and the
core's client then starts a new core, which spawns a new group.
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch

from engine.model.arch import ModelArch
from engine.attention import AttentionMetadata, select_attention
from engine.kv.int8 import Int8KV
from engine.kv.pool import allocate_kv_pair
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel_linear import ModelShard
from engine.model.ranks import ModelRanks
from engine.parallel.block_copy import (RankBlockCopier, assemble, local_bytes, pool_tensors, read_local,
                                       split_payloads, write_local)
from engine.parallel.comm import Group, backend_for

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


# ---- one rank's model ------------------------------------------------------------------------
def build_shard(arch: ModelArch, hf_config: Any, max_len: int, shard_sd: dict[str, torch.Tensor],
                attention_backend: str, linear_backend: str, dtype: torch.dtype, group: Group, vocab_size: int,
                device: torch.device = torch.device("cpu"), block_size: int = 16) -> LlamaForCausalLM:
    """Rank ``group.rank``'s model: ``arch`` is the rank's (``shard_arch``), ``vocab_size`` the full one."""
    model = LlamaForCausalLM(arch, hf_config, max_len, ModelShard(group, vocab_size)).to(dtype)
    model.load_hf_state_dict(shard_sd)
    model = model.to(device)
    model.attn = select_attention(attention_backend, device, dtype, block_size)
    model.eval()
    model.select_linear_backend(linear_backend)
    return model


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``r`` of a CUDA group runs on ``cuda:r`` (of the visible GPUs); every CPU rank on the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts, dataclasses) on ``device``; the
    objects themselves are copied only when a tensor inside moved."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (list, tuple)):
        moved = [to_device(x, device) for x in obj]
        if all(a is b for a, b in zip(moved, obj)):
            return obj
        return type(obj)(moved) if isinstance(obj, list) or type(obj) is tuple else type(obj)(*moved)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            moved = to_device(value, device)
            if moved is not value:
                changes[f.name] = moved
        if not changes:
            return obj
        out = copy.copy(obj)
        for name, value in changes.items():
            object.__setattr__(out, name, value)
        return out
    return obj


# ---- the other ranks ----------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int, arm_pdeathsig: bool) -> None:
    """A worker must not outlive the engine (a SIGKILLed engine leaves no one to stop it).

    On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``). That signal
    follows the *thread* that spawned the worker, so it is armed only when rank 0 launched
    from its main thread; a thread polling ``getppid`` covers every other case (and a parent
    that died before the signal was armed).
    """
    if arm_pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no libc prctl: the polling thread alone
            pass
    if os.getppid() != parent:
        os._exit(0)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=poll, name="kvserve-tp-parent", daemon=True).start()


PARENT_POLL_S = 0.2


def _worker(rank: int, world: int, port: int, arch: ModelArch, hf_config: Any, max_len: int,
            shard_sd: dict[str, torch.Tensor], attention_backend: str, linear_backend: str, dtype: torch.dtype,
            num_threads: int, vocab_size: int, parent: int, arm_pdeathsig: bool, device_type: str) -> None:
    _die_with_parent(parent, arm_pdeathsig)
    torch.set_num_threads(num_threads)
    device = rank_device(device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = Group.create(rank, world, port, backend=backend_for(device))  # the model's collectives use it
    model = build_shard(arch, hf_config, max_len, shard_sd, attention_backend, linear_backend, dtype, group,
                        vocab_size, device)
    del shard_sd
    group.store.set(f"ready/{rank}", "1")  # rank 0 waits for this before it builds the groups
    group.connect()
    _serve(group, model, arch, dtype, device)
    # Nothing to flush: skip the interpreter's teardown (seconds of torch and gloo destructors on a
    # loaded machine, which rank 0's ``close`` would wait for).
    sys.stderr.flush()
    os._exit(0)


def _serve(group: Group, model: LlamaForCausalLM, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
    """Run rank 0's broadcast steps until ``stop`` or until rank 0 is gone."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    while True:
        try:
            msg = group.broadcast_object()
        except RuntimeError:  # rank 0 is gone (its process exited or died): so is the engine
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind in ("forward", "kv_read", "kv_write"):
            msg = to_device(msg, device)
            kv_shape, int8_kv = msg[-2], msg[-1]  # rank 0's pool layout travels with each message
            if (not kv_caches or tuple(kv_caches[0][0].shape) != tuple(kv_shape)
                    or isinstance(kv_caches[0][0], Int8KV) != int8_kv):
                # First use, or rank 0 reallocated its pool (CUDA sizes it after a profiling run).
                kv_caches = []
                kv_caches = [allocate_kv_pair(kv_shape, "int8" if int8_kv else "auto", dtype, device)
                             for _ in range(arch.num_layers)]
            if kind == "forward":
                model(msg[1], msg[2], msg[3], kv_caches)
            elif kind == "kv_read":
                group.gather_cpu(read_local(pool_tensors(kv_caches), msg[1]))
            else:
                tensors = pool_tensors(kv_caches)
                like = torch.empty(local_bytes(tensors, len(msg[1])), dtype=torch.uint8)
                write_local(tensors, msg[1], group.scatter_cpu(None, like))
        elif kind == "logits":
            model.compute_logits(to_device(msg[1], device))


# ---- rank 0 -------------------------------------------------------------------------------------
READY_POLL_S = 0.2


def wait_for_ranks(store: Any, procs: list, timeout_s: float) -> None:
    """Wait until every rank process has built its shard (its ``ready/<rank>`` key is set).

    A rank that exits first (an import or load error, a kill) raises at once with its exit code:
    building the groups would otherwise wait for it until the store's timeout.
    """
    deadline = time.monotonic() + timeout_s
    for rank, proc in enumerate(procs, start=1):
        while not store.check([f"ready/{rank}"]):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} before it was "
                                   "ready; see its log above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} was not ready within {timeout_s:.0f}s")
            time.sleep(READY_POLL_S)


def launch(arch: ModelArch, hf_config: Any, state_dict: dict[str, torch.Tensor], world: int, max_len: int,
           attention_backend: str, linear_backend: str, dtype: torch.dtype, num_threads: int, device: torch.device,
           block_size: int = 16, startup_timeout_s: float = 600) -> LlamaForCausalLM:
    """Shard ``state_dict``, spawn ranks 1..world-1, build rank 0's shard, connect the group;
    return rank 0's model (its ``arch`` the per-rank numbers, so the runner's KV pool holds this
    rank's heads; its ``ranks`` a :class:`TensorParallelRanks`).

    CPU: gloo, every rank on the CPU. CUDA: NCCL, rank ``r`` on ``cuda:r`` (this process is
    rank 0 and uses ``cuda:0``); needs ``world`` visible GPUs.
    """
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor_parallel_size > 1 runs on cpu (gloo) or cuda (NCCL), not {device.type}")
    if linear_backend == "gguf":
        raise ValueError("linear_backend 'gguf' does not shard; use 'auto', 'onednn' or 'aten' with "
                         "tensor_parallel_size > 1")
    if device.type == "cuda":
        if torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, torch sees "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
        device = rank_device("cuda", 0)
        torch.cuda.set_device(device)
    local = shard_arch(arch, world)
    linear = "aten" if linear_backend == "aten" or device.type == "cuda" else "onednn"
    backend = backend_for(device)
    group = Group.create(0, world, backend=backend)
    ctx = mp.get_context("spawn")
    arm = threading.current_thread() is threading.main_thread()
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=_worker, name=f"kvserve-tp{rank}", daemon=True,
                        args=(rank, world, group.port, local, hf_config, max_len,
                              shard_state_dict(state_dict, arch, rank, world), attention_backend, linear, dtype,
                              num_threads, arch.vocab_size, os.getpid(), arm, device.type))
        p.start()
        procs.append(p)
    try:
        model = build_shard(local, hf_config, max_len, shard_state_dict(state_dict, arch, 0, world),
                            attention_backend, linear, dtype, group, arch.vocab_size, device, block_size)
        wait_for_ranks(group.store, procs, startup_timeout_s)
        group.connect()
    except BaseException:
        for p in procs:  # no half-started group left behind
            p.kill()
            p.join(5)
        raise
    logger.info("Tensor parallel: %d ranks over %s (this process is rank 0 on %s; %d query heads, %d KV heads "
                "and %d vocabulary rows per rank; rank pids %s)", world, backend, device, local.num_heads,
                local.num_kv_heads, local.vocab_size, [p.pid for p in procs])
    ranks = TensorParallelRanks(group, procs, device)
    model.ranks = ranks
    ref = weakref.ref(ranks)
    atexit.register(lambda: (r := ref()) is not None and r.close())  # stop the workers cleanly
    return model


class TensorParallelRanks(ModelRanks):
    """Rank 0's handle on the group: it announces each step and LM-head call to ranks 1..N-1
    (which run the same on their shards), copies the tiers' blocks across every rank's pool, and
    owns the rank processes.

    Lifecycle: ``close`` stops the other ranks (also at interpreter exit); they end on their own
    when this process dies (``_die_with_parent``). ``watch`` reports a rank that died while the
    group was open: the group is then broken for good (every collective fails), so the owner
    must end this engine (the core process exits and its client starts a new core and group).
    """

    def __init__(self, group: Group, procs: list, device: torch.device) -> None:
        self.group = group
        self.procs = procs
        self.device = device
        self._closed = False

    def _broadcast(self, msg: tuple) -> None:
        # Control messages travel as pickled bytes over gloo: CUDA tensors go to the CPU first.
        self.group.broadcast_object(msg if self.device.type == "cpu" else to_device(msg, torch.device("cpu")))

    def announce_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                         kv_caches: list) -> None:
        self._broadcast(("forward", input_ids, positions, meta, *self._pool_layout(kv_caches)))

    def announce_logits(self, hidden: torch.Tensor) -> None:
        self._broadcast(("logits", hidden))

    @staticmethod
    def _pool_layout(kv_caches: list) -> tuple[tuple[int, ...], bool]:
        """(shape, int8) of rank 0's pool: every message that touches the pool carries it last."""
        return tuple(kv_caches[0][0].shape), isinstance(kv_caches[0][0], Int8KV)

    def read_kv_blocks(self, kv_caches: list, block_ids: list[int]) -> list[bytes]:
        """Full-head tier payloads of ``block_ids`` gathered from every rank (engine/parallel/block_copy.py)."""
        self._broadcast(("kv_read", list(block_ids), *self._pool_layout(kv_caches)))
        tensors = pool_tensors(kv_caches)
        return assemble(self.group.gather_cpu(read_local(tensors, block_ids)), tensors, len(block_ids))

    def write_kv_blocks(self, kv_caches: list, block_ids: list[int], payloads: list[bytes]) -> None:
        """Every rank copies its heads of the full-head ``payloads`` into ``block_ids``."""
        self._broadcast(("kv_write", list(block_ids), *self._pool_layout(kv_caches)))
        tensors = pool_tensors(kv_caches)
        chunks = split_payloads(payloads, tensors, self.group.world_size)
        write_local(tensors, block_ids, self.group.scatter_cpu(chunks, chunks[0]))

    def block_copier(self, kv_caches: list) -> RankBlockCopier:
        """The tiers' block copier over every rank's pool."""
        return RankBlockCopier(self, kv_caches)

    def watch(self, on_lost: Callable[[int, int | None], None]) -> bool:
        """Call ``on_lost(rank, exitcode)`` (from a daemon thread) when a rank process ends while
        the group is open; nothing after ``close``."""
        from multiprocessing.connection import wait

        def watch() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
            ready = wait(list(sentinels))
            if self._closed:
                return
            rank = sentinels[ready[0]]
            on_lost(rank, self.procs[rank - 1].exitcode)

        threading.Thread(target=watch, name="kvserve-tp-watch", daemon=True).start()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # With a rank dead the group is broken: a broadcast to it may block (gloo has no short
        # timeout, since idle ranks wait in one), so the live ranks are killed below instead. A
        # rank counts as dead once its sentinel is ready: a killed process closes it while it is
        # still exiting, when is_alive() can still say True (that window had hung this broadcast).
        from multiprocessing.connection import wait

        stopping = all(p.is_alive() for p in self.procs) and not wait([p.sentinel for p in self.procs], timeout=0)
        if stopping:
            try:
                self._broadcast(("stop",))
            except Exception:  # noqa: BLE001 - a worker died meanwhile: nothing to stop
                logger.debug("no stop for the tensor-parallel workers: one has exited", exc_info=True)
        for p in self.procs:
            p.join(10 if stopping else 0)
            if p.is_alive():
                p.kill()
                p.join(5)
