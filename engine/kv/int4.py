"""int4 KV blocks (KIVI): keys per channel within each block, values per token, the open block in
the model's dtype.

Layout, per layer (``Int4KV``, one for K and one for V; the first dimension of every block
tensor is the block id, so the tier copies and block copies carry a block whole):

* ``codes`` uint8 ``[blocks, block_size, kv_heads, head_dim / 2]``: two 4-bit codes per byte,
  channel ``2i`` in the low nibble and ``2i + 1`` in the high one; value = code * step + minimum,
  code in 0..15 (asymmetric ranges: keys have a few large channels of one sign).
* keys (``per_channel``): ``scale`` float16 ``[blocks, kv_heads, 2, head_dim]``, a (step, minimum)
  per channel over the block's tokens, per KV head (KIVI's key grouping, the block as the group);
* values: ``scale`` float16 ``[blocks, block_size, kv_heads, 2]``, a (step, minimum) per token and head.
* ``Int4Residual`` (one per pool, shared by every layer's K and V): the block a sequence is
  filling is held in the model's dtype (``residual`` ``[slots, block_size, kv_heads, head_dim]``
  per layer and K/V) until it is full, since a block's per-channel key ranges are known only
  then (KIVI's residual, here one block long); ``slot_of[block]`` (int32) names the residual slot
  of an open block and is -1 for a quantized one. A reader takes a block from the residual when
  ``slot_of[block] >= 0`` and dequantizes it otherwise; nothing else (length, position) decides.
  ``slots`` is ``max_num_seqs``: a running sequence holds at most one open block (only the last
  block of a sequence is ever partial, and only full blocks are shared by prefix caching).

Bytes per token, per layer and KV head (``kv_bytes_per_token``): keys ``head_dim / 2 +
4 head_dim / block_size``, values ``head_dim / 2 + 4``: 84 at head_dim 64 and block 16, against
512 in fp32 (6.10x); ``block_size`` must divide ``4 head_dim`` so that it is a whole number.
The residual is a fixed ``residual_bytes`` = ``slots * block_size * 2 * layers * kv_heads *
head_dim * model dtype bytes`` that the pool's sizing takes off the budget first
(``num_blocks_for_budget``).

The write (``write_int4``): each step, the runner's ``Int4Residual.plan`` (from the step's slot
mapping, before the forward pass) sorts the new rows into those that go to a residual slot, the
blocks filled entirely by this step (quantized straight from the new rows) and the open blocks
that this step completes (quantized from their residual); it allocates a slot for each block the
step opens and frees the slots of the blocks it completes (``slot_of`` is updated then, so every
layer of the step reads the completed blocks as int4, which its write has just made them). Slots
of blocks that went back to the pool half filled (a finished or preempted request) are reclaimed
when the slots run out, by asking the block pool which blocks are still held (``block_in_use``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.platform import huge_pages

LEVELS = 15  # 4-bit codes 0..15
SCALE_DTYPE = torch.float16
MIN_STEP = 1e-6  # a constant channel still gets a finite (fp16-representable) step


def check_geometry(block_size: int, head_dim: int) -> None:
    if head_dim % 2 or (4 * head_dim) % block_size:
        raise ValueError(f"kv_cache_dtype int4 needs an even head_dim and a block_size dividing 4 * head_dim "
                         f"(per-channel key scales per block), got head_dim {head_dim}, block_size {block_size}")


def int4_bytes_per_token_head(block_size: int, head_dim: int) -> int:
    """K + V bytes one token of one KV head costs in the int4 blocks (the residual not included)."""
    check_geometry(block_size, head_dim)
    key = head_dim // 2 + 2 * SCALE_DTYPE.itemsize * head_dim // block_size
    value = head_dim // 2 + 2 * SCALE_DTYPE.itemsize
    return key + value


def residual_bytes(slots: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   model_dtype: torch.dtype) -> int:
    """The open blocks' memory: ``slots`` blocks of K and V in the model's dtype, every layer."""
    return slots * block_size * 2 * num_layers * num_kv_heads * head_dim * model_dtype.itemsize


# ---- the format, in torch: the reference every kernel is tested against ----------------------
def _round_scale(step: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return step.clamp_min(MIN_STEP).to(SCALE_DTYPE), low.to(SCALE_DTYPE)


def _codes(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` under the stored (fp16) step and minimum, packed two per byte."""
    c = torch.round((x - low.float()) / step.float()).clamp_(0, LEVELS).to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., d / 2]`` -> float32 codes ``[..., d]``."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full blocks ``[n, block_size, kv_heads, d]`` -> (codes, scale ``[n, kv_heads, 2, d]``)."""
    x = x.float()
    low, high = x.amin(dim=1), x.amax(dim=1)  # [n, kv_heads, d]
    step, low = _round_scale((high - low) / LEVELS, low)
    return _codes(x, step[:, None], low[:, None]), torch.stack([step, low], dim=2)


def quantize_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., d]`` -> (codes, scale ``[..., 2]``), a range per row."""
    x = x.float()
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    step, low = _round_scale((high - low) / LEVELS, low)
    return _codes(x, step, low), torch.cat([step, low], dim=-1)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return unpack(codes) * s[:, None, :, 0] + s[:, None, :, 1]


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return unpack(codes) * s[..., :1] + s[..., 1:]


# ---- the pool -------------------------------------------------------------------------------
@dataclass
class Int4Plan:
    """Where one step's new rows go (``Int4Residual.plan``), shared by every layer's write."""

    num_rows: int
    res_rows: torch.Tensor  # long [n]: rows of the step that go to a residual slot
    res_slots: torch.Tensor  # long [n]: their flat residual positions (slot * block_size + offset)
    direct_blocks: torch.Tensor  # long [m]: blocks the step fills entirely
    direct_rows: torch.Tensor  # long [m, block_size]: their rows, in offset order
    done_blocks: torch.Tensor  # long [f]: open blocks the step completes
    done_slots: torch.Tensor  # long [f]: their residual slots (freed after the plan)

    def split(self, n: int) -> tuple["Int4Plan", "Int4Plan"]:
        """(rows ``[0, n)``, rows ``[n, num_rows)`` renumbered from 0): the plans of a step whose
        first ``n`` rows (the decode rows) are written by another call than the rest. A block
        belongs to the rows that write it: one sequence's rows, all on one side."""
        bs = self.direct_rows.shape[1]
        head = self.res_rows < n
        direct = self.direct_rows[:, 0] < n
        # an open block is completed by the row that writes its last offset
        done = torch.isin(self.done_slots * bs + bs - 1, self.res_slots[head])

        def part(keep_res: torch.Tensor, keep_direct: torch.Tensor, keep_done: torch.Tensor, shift: int,
                 rows: int) -> Int4Plan:
            return Int4Plan(rows, self.res_rows[keep_res] - shift, self.res_slots[keep_res],
                            self.direct_blocks[keep_direct], self.direct_rows[keep_direct] - shift,
                            self.done_blocks[keep_done], self.done_slots[keep_done])

        return part(head, direct, done, 0, n), part(~head, ~direct, ~done, n, self.num_rows - n)


@dataclass
class Int4Residual:
    """The open blocks' residual slots, shared by every layer (see the module docstring)."""

    num_slots: int
    block_size: int
    slot_of: torch.Tensor  # int32 [num_blocks + 1] on the pool's device: -1 = quantized
    block_in_use: Callable[[int], bool] | None = None  # set by the engine from its block pool
    _slot_of: list[int] = field(default_factory=list)  # host mirror
    _free: list[int] = field(default_factory=list)
    plan_: Int4Plan | None = None

    @classmethod
    def create(cls, num_slots: int, num_blocks: int, block_size: int, device: torch.device) -> "Int4Residual":
        return cls(num_slots, block_size, torch.full((num_blocks,), -1, dtype=torch.int32, device=device),
                   _slot_of=[-1] * num_blocks, _free=list(range(num_slots - 1, -1, -1)))

    def _take_slot(self, step_blocks: set[int]) -> int:
        if not self._free:  # reclaim the slots of half-filled blocks that went back to the pool
            for block, slot in enumerate(self._slot_of):
                if slot >= 0 and block not in step_blocks and self.block_in_use is not None \
                        and not self.block_in_use(block):
                    self._slot_of[block] = -1
                    self._free.append(slot)
        if not self._free:
            raise RuntimeError(f"int4 KV: all {self.num_slots} residual slots hold open blocks")
        return self._free.pop()

    def plan(self, slots: list[int]) -> Int4Plan:
        """Sort the step's flat ``slots`` (one per new row, in row order) and update ``slot_of``."""
        bs = self.block_size
        by_block: dict[int, list[tuple[int, int]]] = {}
        for row, s in enumerate(slots):
            by_block.setdefault(s // bs, []).append((s % bs, row))
        res_rows, res_slots, direct_blocks, direct_rows, done_blocks, done_slots = [], [], [], [], [], []
        freed: list[int] = []
        step_blocks = set(by_block)
        for block, items in by_block.items():
            items.sort()
            first, last = items[0][0], items[-1][0]
            slot = self._slot_of[block]
            if first == 0 and last == bs - 1 and len(items) == bs:  # filled by this step alone
                direct_blocks.append(block)
                direct_rows.append([row for _, row in items])
                if slot >= 0:  # a stale slot of the block's previous owner
                    freed.append(slot)
                    self._slot_of[block] = -1
                continue
            if slot < 0:
                if first != 0:
                    raise RuntimeError(f"int4 KV: block {block} is written from offset {first} without "
                                       "its residual (its earlier tokens are lost)")
                slot = self._slot_of[block] = self._take_slot(step_blocks)
            res_rows.extend(row for _, row in items)
            res_slots.extend(slot * bs + off for off, _ in items)
            if last == bs - 1:
                done_blocks.append(block)
                done_slots.append(slot)
                freed.append(slot)
                self._slot_of[block] = -1
        self._free.extend(freed)  # after this step's allocations: its writes still read them
        dev = self.slot_of.device
        long = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        self.slot_of.copy_(torch.tensor(self._slot_of, dtype=torch.int32))
        self.plan_ = Int4Plan(len(slots), long(res_rows), long(res_slots), long(direct_blocks),
                              long(direct_rows).view(-1, bs), long(done_blocks), long(done_slots))
        return self.plan_

    @contextmanager
    def rows_from(self, n: int) -> Iterator[None]:
        """Inside, the step's plan is that of its rows from ``n`` on (``Int4Plan.split``): for the
        Python layers of a mixed step whose first ``n`` rows the native decode path wrote."""
        full = self.plan_
        assert full is not None, "int4 KV: the step's write plan is missing"
        self.plan_ = full.split(n)[1]
        try:
            yield
        finally:
            self.plan_ = full

    def release(self, block: int) -> None:
        """``block`` now holds quantized content written from elsewhere (a tier load): drop the
        slot a half-filled earlier owner may have left on it, or readers would take the residual."""
        slot = self._slot_of[block]
        if slot >= 0:
            self._slot_of[block] = -1
            self._free.append(slot)
            self.slot_of[block] = -1

    @property
    def open_blocks(self) -> dict[int, int]:
        """block -> residual slot, for tests."""
        return {b: s for b, s in enumerate(self._slot_of) if s >= 0}


@dataclass
class Int4KV:
    """One layer's K (``per_channel``) or V int4 pool plus its residual blocks."""

    codes: torch.Tensor
    scale: torch.Tensor
    residual: torch.Tensor  # model dtype [slots, block_size, kv_heads, head_dim]
    state: Int4Residual
    per_channel: bool
    out_dtype: torch.dtype = torch.float32

    @classmethod
    def zeros(cls, shape: tuple[int, ...], per_channel: bool, state: Int4Residual, out_dtype: torch.dtype,
              device: torch.device) -> "Int4KV":
        blocks, bs, kvh, d = shape
        check_geometry(bs, d)
        scale_shape = (blocks, kvh, 2, d) if per_channel else (blocks, bs, kvh, 2)
        return cls(huge_pages.zeros_on(device, (blocks, bs, kvh, d // 2), torch.uint8),
                   huge_pages.zeros_on(device, scale_shape, SCALE_DTYPE),
                   huge_pages.zeros_on(device, (state.num_slots, bs, kvh, d), out_dtype),
                   state, per_channel, out_dtype)

    @property
    def shape(self) -> torch.Size:
        blocks, bs, kvh, half = self.codes.shape
        return torch.Size((blocks, bs, kvh, 2 * half))

    def tensors(self) -> list[torch.Tensor]:
        """What a block is (the tiers' payload): codes and scales; open blocks are never copied."""
        return [self.codes, self.scale]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_keys(x) if self.per_channel else quantize_values(x)

    def dequantize(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` as ``[n, block_size, kv_heads, d]`` in ``out_dtype``, open blocks
        taken from the residual."""
        codes, scale = self.codes.index_select(0, block_ids), self.scale.index_select(0, block_ids)
        out = dequantize_keys(codes, scale) if self.per_channel else dequantize_values(codes, scale)
        out = out.to(self.out_dtype)
        slots = self.state.slot_of.index_select(0, block_ids).long()
        open_ = (slots >= 0).nonzero().flatten()
        if open_.numel():
            out[open_] = self.residual.index_select(0, slots[open_]).to(self.out_dtype)
        return out


def write_int4(cache: Int4KV, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's new rows ``[T, kv_heads, d]`` into the pool as the step's plan says."""
    plan = cache.state.plan_
    if plan is None or plan.num_rows != x.shape[0]:
        raise RuntimeError("int4 KV: the step's write plan is missing (ModelRunner.prepare_inputs makes it)")
    kvh, d = x.shape[1], x.shape[2]
    if plan.res_rows.numel():
        rows = x.index_select(0, plan.res_rows).to(cache.residual.dtype)
        cache.residual.view(-1, kvh, d).index_copy_(0, plan.res_slots, rows)
    parts, blocks = [], []
    if plan.direct_blocks.numel():
        parts.append(x[plan.direct_rows].float())
        blocks.append(plan.direct_blocks)
    if plan.done_blocks.numel():
        parts.append(cache.residual.index_select(0, plan.done_slots).float())
        blocks.append(plan.done_blocks)
    if parts:
        codes, scale = cache.quantize(torch.cat(parts))
        ids = torch.cat(blocks)
        cache.codes.index_copy_(0, ids, codes)
        cache.scale.index_copy_(0, ids, scale.to(SCALE_DTYPE))


def gather_int4(cache: Int4KV, block_ids: torch.Tensor, num_seqs: int, length: int) -> torch.Tensor:
    """As ``attention.gather_kv``, dequantized: ``[num_seqs, kv_heads, length, head_dim]``."""
    kvh, d = cache.codes.shape[-2], 2 * cache.codes.shape[-1]
    return cache.dequantize(block_ids).view(num_seqs, -1, kvh, d)[:, :length].transpose(1, 2)
