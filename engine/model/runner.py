"""Turn a SchedulerOutput into one forward pass and one sampling call.

The runner holds the paged KV pool (one K and one V tensor per layer, allocated by
``engine.kv.pool``) and owns the per-request random generators.
Step metadata is built once per step, never per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk
from engine.model.cuda_graphs import CudaGraphRunner
from engine.kv.pool import allocate_kv_pool
from engine.model.rope_shift import apply_rope_shifts
from engine.model.llama import LlamaForCausalLM
from kvtypes.outputs import TokenLogprob
from engine.sampling.sampler import Sampler, SamplingRow
from engine.sampling.verification import verify_drafts
from kvtypes.sampling_params import SamplingParams
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # A row that ran a draft: the run it emits (engine/sampling/verification.py), the accepted
    # draft tokens then the model's own token after them; token_id is the first of the run.
    run_token_ids: list[int] | None = None

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (0 for a row without a draft)."""
        return len(self.run_token_ids) - 1 if self.run_token_ids else 0


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
                 kv_cache_dtype: str = "auto", max_num_seqs: int = 64) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs  # an int4 pool's residual slots (engine/kv/int4.py)
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype  # "auto": the model's dtype; "int8": engine/kv/int8.py; "float16"
        self.allocate_kv(num_blocks)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.num_tokens_computed = 0  # tokens that went through the model, for tests and stats
        self.graphs: CudaGraphRunner | None = None
        # H2O (cache/eviction/h2o.py): the attention backend exports per-block attention mass;
        # ``block_mass`` collects it per evicting request (block-table order) until taken.
        self.export_block_mass = False
        self.block_mass: dict[str, list[float]] = {}

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate the pool: ``num_blocks`` blocks for the cache manager plus one sink
        block (index ``num_blocks``) that padded CUDA-graph rows write to (engine/kv/pool.py)."""
        arch = self.model.arch
        self.kv_caches = []  # drop the old pool before allocating the new one
        self.kv_caches = allocate_kv_pool(num_blocks, self.block_size, arch.num_layers, arch.num_kv_heads,
                                          arch.head_dim, self.kv_cache_dtype, self.dtype, self.device,
                                          residual_slots=self.max_num_seqs)
        self.sink_block = num_blocks
        # int4: the open blocks every layer shares; each step's writes are planned once in prepare_inputs.
        self.kv_residual = self.kv_caches[0][0].state if self.kv_cache_dtype == "int4" and self.kv_caches else None

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Capture decode graphs when the device is CUDA and the backend allows it; True if captured."""
        if self.device.type != "cuda" or not self.model.attn.graph_safe_decode or self.kv_residual is not None:
            return False  # int4: each step's write plan is made on the host
        self.graphs = self.padded_decode_runner(max_num_seqs, max_model_len)
        self.graphs.capture()
        return True

    def padded_decode_runner(self, max_num_seqs: int, max_model_len: int) -> CudaGraphRunner:
        """The bucketed, padded decode path over this runner's pool (not yet captured)."""
        return CudaGraphRunner(self.model, self.kv_caches, max_num_seqs, max_model_len, self.block_size,
                               self.sink_block, self.device)

    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """One forward pass at the largest step the scheduler may plan (``num_tokens`` prompt
        tokens over ``num_seqs`` sequences, each sampling), for memory profiling. Needs a pool
        of at least ``profile_blocks(num_tokens, num_seqs)`` blocks."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        per_seq = num_tokens // num_seqs
        blocks_per_seq = (per_seq + num_tokens % num_seqs + self.block_size - 1) // self.block_size
        scheduled = []
        for i in range(num_seqs):
            n = per_seq + (num_tokens % num_seqs if i == 0 else 0)
            req = Request(request_id=f"profile-{i}", prompt_token_ids=[0] * n,
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=1), max_tokens=1)
            ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            scheduled.append(ScheduledRequest(req, n, ids))
        self.execute(SchedulerOutput(scheduled=scheduled))
        self.num_tokens_computed = 0

    def profile_blocks(self, num_tokens: int, num_seqs: int) -> int:
        num_seqs = max(1, min(num_seqs, num_tokens))
        longest = num_tokens // num_seqs + num_tokens % num_seqs
        return num_seqs * ((longest + self.block_size - 1) // self.block_size)

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

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The flat inputs of one forward pass over ``scheduled``: token ids, positions and the
        attention metadata (slot mapping, block tables). Public so that a bench can run the model
        on a step it built itself, as ``execute`` does."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]

        # Past an eviction (cache/eviction) a token's cache slot and rotary position differ from
        # its text position t: slot index t - num_evicted_tokens, position t - position_shift.
        ctx_lens: list[int] = []
        for item in decodes:  # sorted by context length (see execute)
            pos = item.request.num_computed_tokens
            input_ids.append(item.request.all_token_ids[pos])
            positions.append(pos - item.position_shift)
            at = pos - item.num_evicted_tokens
            slots.append(item.block_ids[at // bs] * bs + at % bs)
            ctx_lens.append(at + 1)
        groups = []
        # A kernel that reads each row's own length in place pays nothing for padding.
        native = self.model.attn.reads_lengths_in_place
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
            row = len(input_ids)
            input_ids.extend(item.input_token_ids())
            text_start = item.request.num_computed_tokens
            positions.extend(range(text_start - item.position_shift, text_start - item.position_shift
                                   + item.num_new_tokens))
            start = text_start - item.num_evicted_tokens  # in the cache from here on
            end = start + item.num_new_tokens
            block_ids = item.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            table = mask = None
            if start > 0:
                table = torch.tensor(block_ids[:(end + bs - 1) // bs], dtype=torch.long, device=self.device)
                mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
            chunks.append(PrefillChunk(row, row + item.num_new_tokens, end, table, mask))

        if self.kv_residual is not None:
            self.kv_residual.plan(slots)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            decode_groups=groups,
            prefills=chunks,
            paged=self._paged_layout(decodes, prefills) if self.model.attn.uses_paged_layout else None,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta)

    def _graph_logits(self, ordered: list[ScheduledRequest]) -> torch.Tensor | None:
        """Logits from a captured graph when the step is pure decode and a bucket fits, else None."""
        if self.graphs is None or any(s.num_new_tokens != 1 or not s.samples or s.num_evicted_tokens
                                      or s.position_shift for s in ordered):
            return None
        positions = [s.request.num_computed_tokens for s in ordered]
        logits = self.graphs.run([s.request.all_token_ids[p] for s, p in zip(ordered, positions)], positions,
                                 [s.block_ids for s in ordered])
        if logits is not None:
            self.num_tokens_computed += len(ordered)
        return logits

    def _collect_block_mass(self, ordered: list[ScheduledRequest], mass: torch.Tensor) -> None:
        """Row i of ``mass`` is ``ordered[i]`` (decode rows first, then chunks, as the metadata's)."""
        rows = mass.cpu().tolist()
        for item, row in zip(ordered, rows):
            if item.request.evicts:
                acc = self.block_mass.setdefault(item.request.request_id, [0.0] * len(item.block_ids))
                for j in range(len(item.block_ids)):
                    acc[j] += row[j]

    def take_block_mass(self) -> dict[str, list[float]]:
        """The per-block attention mass collected since the last call, by request id (H2O)."""
        out, self.block_mass = self.block_mass, {}
        return out

    def _paged_layout(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> PagedLayout:
        """The step as one varlen batch (see PagedLayout), built on the host and copied once."""
        items = decodes + prefills
        lens = [s.request.num_computed_tokens - s.num_evicted_tokens + s.num_new_tokens for s in items]
        widths = [(n + self.block_size - 1) // self.block_size for n in lens]
        width = max(widths)
        table = torch.zeros((len(items), width), dtype=torch.int32)
        for i, (item, w) in enumerate(zip(items, widths)):
            table[i, :w] = torch.tensor(item.block_ids[:w], dtype=torch.int32)
        q_lens = [s.num_new_tokens for s in items]
        starts = torch.zeros(len(items) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
        pin = self.device.type == "cuda"
        return PagedLayout(query_start=starts.to(self.device, non_blocking=pin),
                           seq_lens=torch.tensor(lens, dtype=torch.int32).to(self.device, non_blocking=pin),
                           block_table=table.to(self.device, non_blocking=pin), num_decodes=len(decodes),
                           max_query_len=max(q_lens), max_seq_len=max(lens))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Run the step; return the sampled token of every request whose step reaches its end."""
        if out.rope_shifts:  # before anything reads or writes the pool this step
            apply_rope_shifts(self.kv_caches, out.rope_shifts, self.model.rope_cos, self.model.rope_sin)
        if out.is_empty:
            return {}
        # The attention layout puts single-token sequences first; keep the same order here.
        # Single-token rows first, shortest context first (decode groups are contiguous runs).
        ordered = sorted((s for s in out.scheduled if s.num_new_tokens == 1),
                         key=lambda s: s.request.num_computed_tokens) + \
            [s for s in out.scheduled if s.num_new_tokens > 1]
        logits = None if self.export_block_mass else self._graph_logits(ordered)
        verifying: list[ScheduledRequest] = []
        if logits is not None:
            sampling = ordered
        else:
            input_ids, positions, meta = self.prepare_inputs(ordered)
            if self.export_block_mass:
                meta.block_mass = torch.zeros(len(ordered), max(len(s.block_ids) for s in ordered),
                                              dtype=torch.float32, device=self.device)
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            self.num_tokens_computed += input_ids.numel()
            if meta.block_mass is not None:
                self._collect_block_mass(ordered, meta.block_mass)
            self._collect_prompt_logprobs(ordered, hidden)
            sampling = []
            last_rows = []
            verify_rows: list[int] = []  # every row of the draft-carrying items, after last_rows
            row = 0
            for item in ordered:
                row += item.num_new_tokens
                if item.draft_token_ids:
                    verifying.append(item)
                    verify_rows.extend(range(row - item.num_new_tokens, row))
                elif item.samples:
                    sampling.append(item)
                    last_rows.append(row - 1)
            if not sampling and not verifying:
                return {}
            rows_needed = last_rows + verify_rows
            if rows_needed != list(range(hidden.shape[0])):  # prefill rows that do not sample, or reordered
                hidden = hidden[torch.tensor(rows_needed, device=self.device)]
            logits = self.model.compute_logits(hidden)
        logits = logits.float()
        sampled = self._verify(verifying, logits[len(sampling):]) if verifying else {}
        logits = logits[:len(sampling)]
        result = self.sampler(logits, [self._row(s) for s in sampling])
        for i, item in enumerate(sampling):
            sampled[item.request.request_id] = SampledToken(
                token_id=result.token_ids[i],
                logprob=result.logprobs[i] if result.logprobs is not None and
                item.request.sampling_params.logprobs is not None else None,
                top_logprobs=result.top_logprobs[i] if result.top_logprobs is not None and
                item.request.sampling_params.logprobs is not None else None,
            )
        return sampled

    def _verify(self, verifying: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledToken]:
        """Each draft-carrying item's emitted run (their rows follow one another in ``logits``):
        greedy acceptance or rejection sampling, as the request samples (verify_drafts)."""
        runs = verify_drafts(logits, [self._row(s) for s in verifying], [s.draft_token_ids for s in verifying])
        return {item.request.request_id: SampledToken(token_id=run[0], run_token_ids=run)
                for item, run in zip(verifying, runs)}

    def _row(self, item: ScheduledRequest) -> SamplingRow:
        request = item.request
        return SamplingRow(params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
                           output_token_ids=request.output_token_ids, generator=self._generator(item),
                           eos_token_ids=request.eos_token_ids, grammar=request.grammar,
                           reasoning=request.reasoning)

    # Logits of this many prompt positions at a time: [256, vocab] floats, not [prompt, vocab].
    _PROMPT_LOGITS_SLICE = 256

    def _collect_prompt_logprobs(self, ordered: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Append to ``request.prompt_logprobs`` the logprob (and top-k) of each prompt token that
        this step's chunk predicts, for requests that asked for prompt logprobs.

        Position p's logits predict token p+1; entries are appended strictly in order, so a chunk
        recomputed after preemption adds nothing it already added.
        """
        row = 0
        for item in ordered:
            request = item.request
            first_row, row = row, row + item.num_new_tokens
            if not request.wants_prompt_logits:
                continue
            k = request.sampling_params.prompt_logprobs or 0
            start = request.num_computed_tokens
            end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
            pos = max(start, len(request.prompt_logprobs))
            while pos < end:
                stop = min(end, pos + self._PROMPT_LOGITS_SLICE)
                logits = self.model.compute_logits(hidden[first_row + pos - start:first_row + stop - start]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(request.prompt_token_ids[pos + 1:stop + 1], device=logits.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                top_ids = top_vals = None
                if k:
                    top_vals, top_ids = logprobs.topk(k, dim=-1)
                    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
                for j, token in enumerate(request.prompt_token_ids[pos + 1:stop + 1]):
                    top = list(zip(top_ids[j], top_vals[j])) if k else []
                    request.prompt_logprobs.append(TokenLogprob(token, chosen[j], top))
                pos = stop
