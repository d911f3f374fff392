"""A process group of its own (no global ``init_process_group``), so that several tensor-parallel
engines, and tests, can live in one process.

Rank 0 hosts the TCPStore on a free loopback port; the other ranks connect to it. gloo runs the
collectives on CPU tensors (NCCL would be the GPU backend; not wired here yet).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Group:
    rank: int
    world_size: int
    store: dist.TCPStore
    pg: dist.ProcessGroup
    comm_seconds: float = 0.0  # wall time spent in collectives on this rank (the bench reports it)

    @classmethod
    def create(cls, rank: int, world_size: int, port: int = 0, timeout_s: float = 300) -> "Group":
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        return cls(rank, world_size, store, None)  # type: ignore[arg-type]

    def connect(self) -> "Group":
        """Build the gloo group (every rank must call it; it waits for all of them)."""
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world_size)
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

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; tensors inside must be on the CPU)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self.pg.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        self.comm_seconds += time.perf_counter() - t0
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())
