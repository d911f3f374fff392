"""A process group of its own (no global ``init_process_group``), so that several tensor-parallel
engines, and tests, can live in one process.

Rank 0 hosts the TCPStore on a free loopback port; the other ranks connect to it.

Two groups share that store (under different prefixes):

- ``pg`` runs the model's collectives (all-reduce, all-gather) on the rank's device: gloo for
  CPU tensors, NCCL for CUDA tensors (each rank on its own GPU, ``cuda:<rank>``).
- ``cpu_pg`` (gloo) broadcasts each step's inputs as pickled bytes. With gloo it is ``pg``
  itself; with NCCL it is a second gloo group, so that control messages never go through GPU
  memory (rank 0 moves the tensors inside a message to the CPU before it is pickled; the other
  ranks move them to their own device).
"""
from __future__ import annotations

# bandit B403: see broadcast_object: rank 0 to its own workers only
import pickle  # nosec B403
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


BACKENDS = ("gloo", "nccl")


def backend_for(device: torch.device) -> str:
    """The collective backend for a rank's device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Group:
    rank: int
    world_size: int
    store: dist.TCPStore
    pg: dist.ProcessGroup | None = None
    backend: str = "gloo"
    cpu_pg: dist.ProcessGroup | None = None
    comm_seconds: float = 0.0  # wall time spent in collectives on this rank (the bench reports it)

    @classmethod
    def create(cls, rank: int, world_size: int, port: int = 0, timeout_s: float = 300,
               backend: str = "gloo") -> "Group":
        if backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        return cls(rank, world_size, store, backend=backend)

    def connect(self) -> "Group":
        """Build the groups (every rank must call it; it waits for all of them). With NCCL the
        caller has already made its GPU current (``torch.cuda.set_device``)."""
        self.cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), self.rank, self.world_size)
        if self.backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), self.rank, self.world_size)
        else:
            self.pg = self.cpu_pg
        return self

    @property
    def port(self) -> int:
        return self.store.port

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pg.allreduce([t]).wait()
        self.comm_seconds += time.perf_counter() - t0
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t0 = time.perf_counter()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([out], [t.contiguous()]).wait()
        self.comm_seconds += time.perf_counter() - t0
        return torch.cat(out, dim=dim)

    def gather_cpu(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's CPU tensor ``t`` (same shape and dtype on every rank) on rank 0, in rank
        order, over the gloo group; None on the other ranks."""
        t0 = time.perf_counter()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        self.cpu_pg.gather([out] if out is not None else [], [t.contiguous()], opts).wait()
        self.comm_seconds += time.perf_counter() - t0
        return out

    def scatter_cpu(self, chunks: list[torch.Tensor] | None, like: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``chunks[r]`` on rank ``r`` (CPU tensors shaped as ``like``, an empty tensor
        of the size every rank expects), over the gloo group; ``chunks`` only on rank 0."""
        t0 = time.perf_counter()
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        out = torch.empty_like(like)
        self.cpu_pg.scatter([out], [[c.contiguous() for c in chunks]] if self.rank == 0 else [], opts).wait()
        self.comm_seconds += time.perf_counter() - t0
        return out

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; tensors inside must be on the CPU)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self.cpu_pg.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu_pg.broadcast(data, 0).wait()
        self.comm_seconds += time.perf_counter() - t0
        # bandit B301: rank 0's own objects over this group's loopback gloo links (docs/security.md)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())  # nosec B301
