"""Turn a SchedulerOutput into one forward pass and one sampling call.

The runner owns the paged KV pool tensors (one K and one V tensor per layer, shape
``[num_blocks, block_size, kv_heads, head_dim]``) and the per-request random generators.
Step metadata is built once per step, never per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow
from scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        arch = model.arch
        self.model = model
        model.select_linear_backend()
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # Zeroed, not empty: masked-out slots still enter the matmul and NaN * 0 is NaN.
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

        decode_blocks = decode_mask = None
        decode_len = 0
        if decodes:
            ctx_lens = []
            tables = []
            for item in decodes:
                pos = item.request.num_computed_tokens
                input_ids.append(item.request.all_token_ids[pos])
                positions.append(pos)
                slots.append(item.block_ids[pos // bs] * bs + pos % bs)
                ctx_lens.append(pos + 1)
                tables.append(item.block_ids)
            decode_len = max(ctx_lens)
            width = (decode_len + bs - 1) // bs
            # Rows shorter than the longest are padded with block 0: finite data, masked out.
            flat: list[int] = []
            for t in tables:
                row = t[:width]
                flat.extend(row)
                if len(row) < width:
                    flat.extend([0] * (width - len(row)))
            decode_blocks = torch.tensor(flat, dtype=torch.long, device=self.device)
            if min(ctx_lens) != decode_len:
                lens = torch.tensor(ctx_lens)
                decode_mask = (torch.arange(decode_len)[None, :] < lens[:, None])[:, None, None, :].to(self.device)

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
            num_decodes=len(decodes),
            decode_block_ids=decode_blocks,
            decode_len=decode_len,
            decode_mask=decode_mask,
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
        ordered = [s for s in out.scheduled if s.num_new_tokens == 1] + \
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
