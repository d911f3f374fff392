"""CUDA graphs for pure-decode steps: one captured graph per batch-size bucket.

A decode step of ``n`` sequences replays the graph of the smallest bucket ``>= n`` with the
rows past ``n`` padded: token 0 at position 0, writing its K/V into the pool's extra sink
block (``ModelRunner`` allocates one block more than the cache manager hands out) and
attending to that one slot only, so padding never touches a live block. Inputs are built
in pinned host memory and copied to the graph's static device tensors without blocking.

``graph_batch_sizes``, ``bucket_for`` and ``build_decode_inputs`` are device-independent
(tested on CPU); ``CudaGraphRunner`` needs a CUDA device.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PagedLayout

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size ``>= n`` (``sizes`` ascending), None when ``n`` exceeds all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """One padded decode batch on the host (int64 ids/positions/slots, int32 table/lengths)."""

    input_ids: torch.Tensor  # [bucket]
    positions: torch.Tensor  # [bucket]
    slot_mapping: torch.Tensor  # [bucket]
    block_table: torch.Tensor  # [bucket, width]
    seq_lens: torch.Tensor  # [bucket]


def build_decode_inputs(token_ids: Sequence[int], positions: Sequence[int], block_ids: Sequence[Sequence[int]],
                        bucket: int, width: int, block_size: int, sink_block: int,
                        out: DecodeInputs | None = None) -> DecodeInputs:
    """Fill (``out``, e.g. pinned buffers of at least ``bucket`` rows) or allocate the inputs
    of ``len(token_ids)`` real decode rows padded to ``bucket`` rows.

    Row ``i`` decodes ``token_ids[i]`` at ``positions[i]`` (its context is ``positions[i] + 1``
    tokens held in ``block_ids[i]``); padded rows point at ``sink_block``. ``width`` is the
    table's column count (the model's context in blocks); unused columns hold the sink too.
    """
    n = len(token_ids)
    if n > bucket:
        raise ValueError(f"{n} rows do not fit a bucket of {bucket}")
    if out is None:
        out = DecodeInputs(torch.empty(bucket, dtype=torch.long), torch.empty(bucket, dtype=torch.long),
                           torch.empty(bucket, dtype=torch.long), torch.empty(bucket, width, dtype=torch.int32),
                           torch.empty(bucket, dtype=torch.int32))
    out.input_ids[:bucket] = 0
    out.positions[:bucket] = 0
    out.slot_mapping[:bucket] = sink_block * block_size
    out.seq_lens[:bucket] = 1
    out.block_table[:bucket] = sink_block
    if n:
        # One index_put for the whole table instead of a copy per row (256 rows per step).
        used = [p // block_size + 1 for p in positions]
        if max(used) > width:
            i = max(range(n), key=used.__getitem__)
            raise ValueError(f"row {i} needs {used[i]} blocks but the table has {width} columns")
        flat = torch.tensor([b for row, u in zip(block_ids, used) for b in row[:u]], dtype=torch.int32)
        counts = torch.tensor(used)
        rows = torch.repeat_interleave(torch.arange(n), counts)
        starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        out.block_table[rows, torch.arange(len(flat)) - starts] = flat
        pos = torch.tensor(positions, dtype=torch.long)
        out.input_ids[:n] = torch.tensor(token_ids, dtype=torch.long)
        out.positions[:n] = pos
        out.seq_lens[:n] = (pos + 1).to(torch.int32)
        last = torch.tensor([row[u - 1] for row, u in zip(block_ids, used)], dtype=torch.long)
        out.slot_mapping[:n] = last * block_size + pos % block_size
    return out


class CudaGraphRunner:
    """Captures ``model`` forward + LM head for each bucket and replays them.

    Without ``capture()`` (on a CPU, in tests) ``run`` executes the same padded static-input
    forward eagerly, which is how the padding and sink logic is tested without a GPU.

    The attention backend must be ``graph_safe_decode``; its decode split count is fixed by
    passing the model's context (``max_model_len``) as the group length.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_model_len: int, block_size: int, sink_block: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.sink_block = sink_block
        self.width = (max_model_len + block_size - 1) // block_size
        self.device = device
        top = self.sizes[-1]
        pin = device.type == "cuda"
        self.host = DecodeInputs(*(torch.empty(shape, dtype=dt, pin_memory=pin) for shape, dt in (
            ((top,), torch.long), ((top,), torch.long), ((top,), torch.long), ((top, self.width), torch.int32),
            ((top,), torch.int32))))
        self.static = DecodeInputs(*(torch.empty_like(t, device=device) for t in (
            self.host.input_ids, self.host.positions, self.host.slot_mapping, self.host.block_table,
            self.host.seq_lens)))
        self.query_start = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # graph replays so far (tests and logs)

    def _meta(self, bucket: int) -> AttentionMetadata:
        s = self.static
        group = DecodeGroup(0, bucket, self.max_model_len, s.block_table[:bucket].reshape(-1).long(), None,
                            s.seq_lens[:bucket])
        layout = PagedLayout(self.query_start[:bucket + 1], s.seq_lens[:bucket], s.block_table[:bucket], bucket, 1,
                             self.max_model_len)
        return AttentionMetadata(slot_mapping=s.slot_mapping[:bucket], decode_groups=[group], prefills=[],
                                 paged=layout)

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        s = self.static
        hidden = self.model(s.input_ids[:bucket], s.positions[:bucket], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        build_decode_inputs([], [], [], self.sizes[-1], self.width, self.block_size, self.sink_block, self.host)
        self._copy_inputs(self.sizes[-1])
        for bucket in reversed(self.sizes):
            meta = self._meta(bucket)
            self._forward(bucket, meta)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bucket] = self._forward(bucket, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    def _copy_inputs(self, bucket: int) -> None:
        for name in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens"):
            getattr(self.static, name)[:bucket].copy_(getattr(self.host, name)[:bucket], non_blocking=True)

    def run(self, token_ids: Sequence[int], positions: Sequence[int],
            block_ids: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` of ``n`` decode rows, or None when no bucket fits ``n``.

        The pinned host buffers are reused: the previous step's copies must have finished,
        which they have, since its sampled tokens were read back (a synchronisation)."""
        bucket = bucket_for(len(token_ids), self.sizes)
        if bucket is None:
            return None
        build_decode_inputs(token_ids, positions, block_ids, bucket, self.width, self.block_size, self.sink_block,
                            self.host)
        self._copy_inputs(bucket)
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (a CPU test of the padding, or capture skipped): run it eagerly
            return self._forward(bucket, self._meta(bucket))[:len(token_ids)]
        graph.replay()
        self.replays += 1
        return self.logits[bucket][:len(token_ids)]
