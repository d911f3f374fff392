"""Turn a SchedulerOutput into one forward pass and one sampling call.

The runner owns the paged KV pool tensors (one K and one V tensor per layer, shape
``[num_blocks, block_size, kv_heads, head_dim]``) and the per-request random generators.
Step metadata is built once per step, never per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from engine.kv_quant import Int8KV
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow
from scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def split_by_length(lengths: list[int], group_cost: int) -> list[tuple[int, int]]:
    """Split ascending ``lengths`` into contiguous groups ``[(start, end), ...]`` minimising
    ``sum(group_cost + rows * longest)``: the tokens each group copies and attends to,
    padding included, plus a fixed price per extra batched call (in tokens). O(n^2), n = rows.
    """
    n = len(lengths)
    if n == 0:
        return []
    if lengths[0] == lengths[-1]:
        return [(0, n)]
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = lengths[end - 1]
        for start in range(end):
            cost = best[start] + group_cost + (end - start) * longest
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append((cut[end], end))
        end = cut[end]
    return groups[::-1]


class ModelRunner:
    # A decode group costs about as much as copying and attending to this many more tokens
    # of context (one more index_select pair and SDPA call per layer).
    group_cost_tokens = 256

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto") -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # Zeroed, not empty: masked-out slots still enter the matmul and NaN * 0 is NaN.
        if kv_cache_dtype == "int8":  # quantized on write, scales per token and head (engine/kv_quant.py)
            self.kv_caches = [(Int8KV.zeros(shape, dtype, self.device), Int8KV.zeros(shape, dtype, self.device))
                              for _ in range(arch.num_layers)]
        else:
            self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                               torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(arch.num_layers)]
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.num_tokens_computed = 0  # tokens that went through the model, for tests and stats

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.request.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(item.request.request_id)
        if gen is None:
            gen = self.generators[item.request.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def _prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]

        for item in decodes:  # sorted by context length (see execute)
            pos = item.request.num_computed_tokens
            input_ids.append(item.request.all_token_ids[pos])
            positions.append(pos)
            slots.append(item.block_ids[pos // bs] * bs + pos % bs)
        groups = []
        ctx_lens = [p + 1 for p in positions]
        # The native kernel reads each row's own length in place: padding costs it nothing.
        native = self.model.attn.native_decode
        split = [(0, len(ctx_lens))] if native and ctx_lens else \
            split_by_length(ctx_lens, self.group_cost_tokens)
        for start, end in split:
            length = max(ctx_lens[start:end])  # the last one when sorted, as execute() does
            width = (length + bs - 1) // bs
            # Rows shorter than the longest are padded with block 0: finite data, masked out.
            flat: list[int] = []
            for item in decodes[start:end]:
                row = item.block_ids[:width]
                flat.extend(row)
                if len(row) < width:
                    flat.extend([0] * (width - len(row)))
            lens = torch.tensor(ctx_lens[start:end])
            mask = None
            if min(ctx_lens[start:end]) != length and not native:
                mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :].to(self.device)
            groups.append(DecodeGroup(start, end, length, torch.tensor(flat, dtype=torch.long, device=self.device),
                                      mask, lens.to(self.device)))

        chunks = []
        for item in prefills:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            row = len(input_ids)
            input_ids.extend(item.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = item.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            table = mask = None
            if start > 0:
                table = torch.tensor(block_ids[:(end + bs - 1) // bs], dtype=torch.long, device=self.device)
                mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
            chunks.append(PrefillChunk(row, row + item.num_new_tokens, end, table, mask))

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_groups=groups,
            prefills=chunks,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the step; return the sampled token of every request whose step reaches its end."""
        if out.is_empty:
            return {}
        # The attention layout puts single-token sequences first; keep the same order here.
        # Single-token rows first, shortest context first (decode groups are contiguous runs).
        ordered = sorted((s for s in out.scheduled if s.num_new_tokens == 1),
                         key=lambda s: s.request.num_computed_tokens) + \
            [s for s in out.scheduled if s.num_new_tokens > 1]
        input_ids, positions, meta = self._prepare(ordered)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        self.num_tokens_computed += input_ids.numel()

        sampling = []
        last_rows = []
        row = 0
        for item in ordered:
            row += item.num_new_tokens
            if item.samples:
                sampling.append(item)
                last_rows.append(row - 1)
        if not sampling:
            return {}
        if len(last_rows) != hidden.shape[0]:  # some rows are prefill tokens that do not sample
            hidden = hidden[torch.tensor(last_rows, device=self.device)]
        logits = self.model.compute_logits(hidden).float()
        rows = [SamplingRow(params=s.request.sampling_params, prompt_token_ids=s.request.prompt_token_ids,
                            output_token_ids=s.request.output_token_ids, generator=self._generator(s),
                            eos_token_ids=s.request.eos_token_ids) for s in sampling]
        result = self.sampler(logits, rows)
        sampled = {}
        for i, item in enumerate(sampling):
            sampled[item.request.request_id] = SampledToken(
                token_id=result.token_ids[i],
                logprob=result.logprobs[i] if result.logprobs is not None and
                item.request.sampling_params.logprobs is not None else None,
                top_logprobs=result.top_logprobs[i] if result.top_logprobs is not None and
                item.request.sampling_params.logprobs is not None else None,
            )
        return sampled
