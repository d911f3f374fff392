"""The synchronous engine: requests in, one scheduled forward pass per ``step()``, outputs out.

It is driven by one thread only: the engine core's loop (``engine/core/loop.py``, in its own
process or, in-process mode, in a thread), or the CLI's offline ``generate``. ``step()``
returns token ids only; text (detokenization, stop strings) is the output processor's job.

Fault contract of ``step()``: if the forward pass raises, the step's requests are retried one
by one; those that raise again finish with ``error`` (blocks freed, detail logged), the others
go on as if nothing happened. Any other exception propagates (the engine state may be broken).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cache import CacheConfig, KVCacheManager, KVCapacity, kv_bytes_per_token, num_blocks_for_memory
from cache.tiers import DiskTier, HostTier, KVTier, TierChain, tier_members
from engine.attention import resolve_backend, select_attention
from engine.config import EngineCoreConfig, ModelConfig
from engine.core.protocol import EngineCoreOutput, EngineInfo, PinSnapshot, PromptTooLongError, StepStats  # noqa: F401 (re-export)
from engine.kv.budget import profile_kv_budget
from engine.platform.host_malloc import limit_malloc_arenas
from engine.kernels import load_kernels
from engine.kv.transfer import KVOffloader, model_fingerprint
from engine.loader import LoadedModel, gguf_source, load_model
from engine.model.llama import LlamaForCausalLM, configure_linear_layers
from engine.model.native_decode import configure_decode_path
from engine.model.runner import ModelRunner, SampledToken, kv_pool_dtype
from engine.core.output_processor import OutputProcessor
from engine.sampling.structured_output import GrammarCompiler, RequestGrammar
from engine.tokenizer import encode_prompt
from kvtypes.outputs import TokenLogprob
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Test-only fault hook: when set, a step that runs a request whose prompt starts with this
# token id raises (see tests/server/test_core_faults.py). Unset in production: one None check.
FAULT_TOKEN_ENV = "KVSERVE_TEST_FAULT_TOKEN"


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    core: EngineCoreConfig = field(default_factory=EngineCoreConfig)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    num_cache_write_tokens: int = 0


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no GPU (install a CUDA build of torch)")
    return torch.device(name)


def build_model(loaded: LoadedModel, max_len: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An empty model with its parameters allocated in ``dtype`` directly on ``device`` (no
    float32 or host copy of an 8B model on the way); weights are loaded afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(loaded.arch, loaded.hf_config, max_len)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype)  # the RoPE tables are computed in float32 and cast, as transformers does


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        limit_malloc_arenas()  # before the load and the first OpenMP region (engine/platform/host_malloc.py)
        torch.set_num_threads(config.model.num_threads or available_cores())
        if config.cache.kv_cache_dtype == config.model.dtype:  # float16 under a float16 model: its own dtype
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype="auto"))
        dtype = _DTYPES[config.model.dtype]
        loaded = loaded or load_model(config.model.model, dtype, self._blocks_only(config.model, dtype))
        arch = loaded.arch
        self.arch = arch
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model.served_model_name or loaded.name

        max_len = config.model.max_model_len or config.scheduler.max_model_len or arch.max_position_embeddings
        if max_len > arch.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context of "
                             f"{arch.max_position_embeddings} tokens")
        self.max_model_len = max_len
        self.config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_model_len=max_len))

        device = resolve_device(config.model.device)
        int8_kv = config.cache.kv_cache_dtype == "int8"
        # Resolved here, once, so that every tensor-parallel rank builds the same backend; with an
        # int8 pool ``auto`` passes over the backends that read float pools only (flash_attn).
        attention_backend = resolve_backend(config.model.attention_backend, device, _DTYPES[config.model.dtype],
                                            config.cache.block_size, config.cache.kv_cache_dtype)
        tier = self._make_tier(config.cache, loaded, config.model.dtype, arch)
        cache_cfg = config.cache
        if cache_cfg.cache_dtype is not None and cache_cfg.cache_dtype != config.model.dtype:
            raise ValueError(f"cache_dtype {cache_cfg.cache_dtype} differs from the model dtype {config.model.dtype}: "
                             "a KV dtype of its own is not implemented (leave cache_dtype unset; kv_cache_dtype "
                             "int8 quantizes the pool)")
        if config.model.tensor_parallel_size > 1:  # engine/parallel: this process is rank 0
            if cache_cfg.kv_cache_dtype == "float16":
                raise ValueError("kv_cache_dtype 'float16' under a float32 model is not implemented with "
                                 "tensor_parallel_size > 1; use 'auto' or 'int8'")
            if config.model.activation_quant != "none":
                raise ValueError("activation_quant 'int8' runs on GGUF blocks, which tensor parallel ranks do not "
                                 "use; use activation_quant 'none'")
            from engine.parallel.tensor_parallel import TensorParallelModel

            model = TensorParallelModel.launch(
                arch, loaded.hf_config, loaded.state_dict, config.model.tensor_parallel_size, max_len,
                attention_backend, config.model.linear_backend, dtype,
                config.model.num_threads or available_cores(), device, cache_cfg.block_size)
            loaded.state_dict.clear()
        else:
            model = build_model(loaded, max_len, dtype, device)
            model.attn = select_attention(attention_backend, device, dtype, cache_cfg.block_size,
                                          cache_cfg.kv_cache_dtype)
            model.load_hf_state_dict(loaded.state_dict, loaded.blocks)
            model.eval()
            loaded.state_dict.clear()  # weights now live in the fused parameters only
            if loaded.blocks is not None:
                loaded.blocks.clear()  # and the blocks in the model's BlockMatrix groups
            model.activation_quant = config.model.activation_quant
            self._select_linear(model, loaded, config.model.linear_backend, device, dtype)
        logger.info("Attention: %s on %s (%s%s)", model.attn.describe(), device, config.model.dtype,
                    "" if cache_cfg.kv_cache_dtype == "auto" else f", {cache_cfg.kv_cache_dtype} KV blocks")
        self._select_decode_path(model, config.model.decode_path, int8_kv)

        # A GPU's budget holds one rank's pool (its own KV heads); host memory holds all ranks' pools.
        kv_heads = model.arch.num_kv_heads if device.type == "cuda" else arch.num_kv_heads
        per_token = kv_bytes_per_token(arch.num_layers, kv_heads, arch.head_dim,
                                       torch.empty((), dtype=kv_pool_dtype(cache_cfg.kv_cache_dtype, dtype)).element_size())
        if int8_kv:  # one byte a value plus a float32 (step, minimum) per token, head, K and V
            full = per_token
            per_token = 2 * arch.num_layers * kv_heads * (arch.head_dim + 8)  # one rank's heads on a GPU
            logger.info("int8 KV blocks: %d bytes/token instead of %d (%.2fx the tokens in the same budget)",
                        per_token, full, full / per_token)
        sched = self.config.scheduler
        if cache_cfg.num_blocks:
            num_blocks = cache_cfg.num_blocks
            self.runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device, cache_cfg.kv_cache_dtype)
        elif device.type == "cuda":
            # Profile with a pool just big enough for the largest step, then size the real one.
            self.runner = ModelRunner(model, 1, cache_cfg.block_size, dtype, device, cache_cfg.kv_cache_dtype)
            tokens, seqs = sched.max_num_batched_tokens, sched.max_num_seqs
            self.runner.allocate_kv(self.runner.profile_blocks(tokens, seqs))
            profile = profile_kv_budget(device, config.model.gpu_memory_utilization,
                                        lambda: self.runner.profile_run(tokens, seqs))
            self.runner.allocate_kv(0)
            logger.info(profile.describe())
            num_blocks = num_blocks_for_memory(profile.kv_budget, cache_cfg.block_size, per_token)
            if num_blocks == 0:
                raise ValueError("no GPU memory is left for the KV cache after loading the model: raise "
                                 "--gpu-memory-utilization or lower --max-num-batched-tokens")
            self.runner.allocate_kv(num_blocks)
        else:
            num_blocks = num_blocks_for_memory(int(cache_cfg.kv_cache_memory_gib * 2**30), cache_cfg.block_size,
                                               per_token)
            self.runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device, cache_cfg.kv_cache_dtype)
        self.capacity = KVCapacity(num_blocks=num_blocks, block_size=cache_cfg.block_size, bytes_per_token=per_token)
        logger.info(self.capacity.describe(max_len))
        # Not with tensor parallelism: each step starts with a host-side broadcast to the other ranks.
        if (config.model.cuda_graphs and config.model.tensor_parallel_size == 1
                and self.runner.capture_cuda_graphs(sched.max_num_seqs, max_len)):
            logger.info("Decode steps replay CUDA graphs (batch sizes up to %d)", sched.max_num_seqs)

        # With tensor parallelism a block's K/V is spread over the ranks: the copier gathers it.
        copier = self.runner.model.block_copier(self.runner.kv_caches)
        self.disk_tier = tier
        host = self._make_host_tier(cache_cfg, copier.payload_bytes, device)
        if host is not None:
            tier = TierChain([host, tier]) if tier is not None else host
        self.kv_cache = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching,
                                       tier=tier, pin_fraction=cache_cfg.kv_pin_fraction)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache)
        self.offloader = KVOffloader(tier, copier) if tier is not None else None
        # Structured output: grammars compile on the compiler's thread; requests whose grammar is
        # not resolved yet wait in _compiling (the scheduler skips them) while others step.
        self.grammars = GrammarCompiler(self.tokenizer, arch.vocab_size) if self.tokenizer is not None else None
        self._compiling: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens run by the latest step (for the iteration_tokens metric)
        self.info = EngineInfo(model_name=self.model_name, max_model_len=max_len, vocab_size=arch.vocab_size,
                               block_size=cache_cfg.block_size, num_blocks=num_blocks,
                               max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
                               dtype=config.model.dtype, enable_prefix_caching=cache_cfg.enable_prefix_caching,
                               has_tokenizer=self.tokenizer is not None, has_disk_tier=self.disk_tier is not None,
                               kv_bytes_per_token=self.capacity.bytes_per_token,
                               kv_cache_dtype=cache_cfg.kv_cache_dtype,
                               max_pinned_blocks=self.kv_cache.max_pinned_blocks)
        fault = os.environ.get(FAULT_TOKEN_ENV)
        self.fault_token_id: int | None = int(fault) if fault else None
        self._reported: tuple = ()  # counters at the previous stats snapshot (deltas are sent)
        self._reported_pins: tuple = ()  # the pin list of the previous snapshot

    @staticmethod
    def _make_tier(cache_cfg: CacheConfig, loaded: LoadedModel, dtype: str, arch) -> DiskTier | None:
        """The disk tier when ``kv_disk_dir`` is set (and prefix caching is on)."""
        if cache_cfg.kv_disk_dir is None or not cache_cfg.enable_prefix_caching:
            return None
        fingerprint = model_fingerprint(loaded.state_dict, model_dtype=dtype,
                                        kv_dtype=cache_cfg.kv_cache_dtype if cache_cfg.kv_cache_dtype != "auto" else dtype,
                                        block_size=cache_cfg.block_size, num_layers=arch.num_layers,
                                        num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)
        tier = DiskTier(cache_cfg.kv_disk_dir, int(cache_cfg.kv_disk_gib * 2**30), fingerprint)
        logger.info("KV disk tier: %s, %.2f GiB, %d blocks found from earlier runs", cache_cfg.kv_disk_dir,
                    cache_cfg.kv_disk_gib, tier.num_entries())
        return tier

    def _make_host_tier(self, cache_cfg: CacheConfig, block_bytes: int, device: torch.device) -> HostTier | None:
        """The host tier when ``kv_offload_gib`` > 0: an arena of whole block payloads, pinned when
        the pool is on a GPU (the arena tensor is kept alive by ``self._host_arena``)."""
        self._host_arena: torch.Tensor | None = None
        if cache_cfg.kv_offload_gib <= 0 or not cache_cfg.enable_prefix_caching:
            return None
        slots = int(cache_cfg.kv_offload_gib * 2**30) // block_bytes
        if slots == 0:
            raise ValueError(f"kv_offload_gib={cache_cfg.kv_offload_gib} does not hold one KV block "
                             f"({block_bytes} bytes)")
        pinned = device.type == "cuda"
        self._host_arena = torch.empty(slots * block_bytes, dtype=torch.uint8, pin_memory=pinned)
        host = HostTier(block_bytes, memoryview(self._host_arena.numpy()))
        if pinned:
            logger.info("KV host tier: %.2f GiB of pinned host memory, %d blocks", cache_cfg.kv_offload_gib, slots)
        else:
            logger.warning("KV host tier: %.2f GiB, %d blocks, in ordinary host memory; the KV pool is on the %s "
                           "already, so this tier duplicates host memory (useful for tests and configuration; on a "
                           "CPU server prefer a larger pool or the disk tier)", cache_cfg.kv_offload_gib, slots,
                           device.type)
        return host

    def close(self) -> None:
        """Write the device pool's and the host tier's cached blocks to the disk tier (so a restart
        finds every prefix, not only the evicted ones), finish pending writes and stop the tier
        threads; with tensor parallelism, stop the other ranks (idempotent; the engine cannot step
        afterwards)."""
        if self.offloader is not None:
            self.offloader.offload(self.kv_cache.take_offloads())
            cached = list(self.kv_cache.block_pool.cached_blocks.items())
            disk = self.disk_tier
            if disk is not None and disk is not self.offloader.tier:  # host -> disk: spill both to disk
                for tier in tier_members(self.offloader.tier):
                    if isinstance(tier, HostTier):
                        for block_hash in tier.hashes():
                            payload = tier.peek(block_hash)
                            if payload is not None and not disk.contains(block_hash):
                                disk.put(block_hash, payload)
                missing = [(h, block.block_id) for h, block in cached if not disk.contains(h)]
                payloads = self.offloader.copier.read_blocks([b for _, b in missing]) if missing else []
                for (block_hash, _), payload in zip(missing, payloads):
                    disk.put(block_hash, payload)
            else:
                self.offloader.offload([(block.block_id, block_hash, 0.0) for block_hash, block in cached])
            self.offloader.close()
            self.offloader = None
        self.runner.model.close()  # tensor parallelism: stop the other ranks

    def watch_ranks(self, on_lost) -> bool:  # noqa: ANN001 - Callable[[int, int | None], None]
        """With tensor parallelism, call ``on_lost(rank, exitcode)`` when another rank dies (the
        engine cannot step any more); False (and nothing watched) with a single rank."""
        return self.runner.model.watch_ranks(on_lost)

    @staticmethod
    def _blocks_only(cfg: ModelConfig, dtype: torch.dtype) -> bool:
        """Whether to load the GGUF as blocks only (``weights_resident``, see ModelConfig)."""
        if cfg.weights_resident == "dense":
            return False
        gguf = gguf_source(cfg.model)
        runnable = (gguf is not None and resolve_device(cfg.device).type == "cpu" and dtype == torch.float32
                    and cfg.linear_backend in ("auto", "gguf") and load_kernels())
        if cfg.weights_resident == "blocks":
            if not runnable:
                raise ValueError("weights_resident 'blocks' needs a .gguf model, a CPU in float32, linear_backend "
                                 "auto or gguf and the native kernels; use 'auto'")
            return True
        return bool(runnable and torch.ops.kvserve.gguf_kernel_isa() == "avx2"
                    and gguf.stat().st_size > cfg.blocks_auto_file_gib * 2**30)

    @staticmethod
    def _select_linear(model: LlamaForCausalLM, loaded: LoadedModel, backend: str, device: torch.device,
                       dtype: torch.dtype) -> None:
        """Attach the GGUF blocks where they may run, bind the matmuls, log (engine/model/llama.py)."""
        configure_linear_layers(model, loaded, backend, device, dtype, logger)

    @staticmethod
    def _select_decode_path(model: LlamaForCausalLM, choice: str, int8_kv: bool) -> None:
        """The decode path (``ModelConfig.decode_path``), chosen and logged (engine/model/native_decode.py)."""
        configure_decode_path(model, choice, int8_kv, logger)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Validate and enqueue; raise ValueError (PromptTooLongError for length) with a user-facing message."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            prompt_ids = encode_prompt(self.tokenizer, prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        self.validate_prompt(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        room = self.max_model_len - len(prompt_ids)
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params,
                          max_tokens=min(params.max_tokens or room, room),
                          eos_token_ids=self.arch.eos_token_ids, cache_salt=cache_salt, priority=priority)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.structured_output is not None:
            request.grammar = RequestGrammar(self.grammars.submit(params.structured_output))
        self.scheduler.add_request(request)
        if request.grammar is not None:
            self._compiling[request_id] = request
        return request_id

    def validate_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.info.validate(prompt_ids, params)

    def abort(self, request_id: str, stopped: bool = False) -> EngineCoreOutput | None:
        """Free a live request's blocks now; returns its final output, or None if it was not live.
        ``stopped``: it ended on a stop string (found by the output processor), so it finishes as
        ``stop`` and its cache policy applies; otherwise as ``abort``."""
        request = self.scheduler.requests.get(request_id)
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        if request is None or not self.scheduler.finish_requests([request_id], status):
            return None
        return self._final(request)

    def abort_all(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[EngineCoreOutput]:
        live = list(self.scheduler.requests)
        return [self._final(request) for request in self.scheduler.finish_requests(live, status)]

    def _final(self, request: Request) -> EngineCoreOutput:
        self.runner.release(request.request_id)
        self._compiling.pop(request.request_id, None)
        return self._output(request, [])

    @staticmethod
    def _output(request: Request, new_token_ids: list[int], logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob] | None = None, error: str | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=new_token_ids,
                                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                logprobs=logprobs, num_prompt_tokens=request.num_prompt_tokens,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                num_cache_write_tokens=request.num_cache_write_tokens,
                                first_scheduled_time=request.first_scheduled_time,
                                prompt_logprobs=prompt_logprobs, error=error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _tiers(self) -> list[KVTier]:
        """The lower tiers, top first (host, disk), each reporting its own stats."""
        return tier_members(self.offloader.tier) if self.offloader is not None else []

    def _counters(self) -> tuple:
        sched = self.scheduler.stats
        return (sched.prefix_cache_queries, sched.prefix_cache_hits, sched.num_preemptions,
                tuple(sorted(sched.tier_queries.items())), tuple(sorted(sched.tier_hits.items())),
                tuple((t.name, t.stats.bytes_read) for t in self._tiers()),
                tuple((t.name, t.stats.bytes_written) for t in self._tiers()))

    def _pin_snapshots(self) -> tuple[PinSnapshot, ...]:
        now = self.kv_cache.clock()
        return tuple(PinSnapshot(hash=p.hash, num_tokens=p.num_tokens, num_blocks=p.num_blocks, ttl_s=p.ttl_s,
                                 ttl_left_s=round(max(0.0, p.expires_at - now), 3), salt_id=p.salt_id)
                     for p in self.kv_cache.list_pins())

    def stats_changed(self) -> bool:
        """Whether a snapshot now would differ from the previous one in pins or counters
        (the idle core sends one then; pin expiry times alone do not count)."""
        keys = tuple(p.hash for p in self.kv_cache.list_pins())
        return (keys != tuple(p.hash for p in self._reported_pins) or self._counters() != self._reported
                or any(t.stats.recent_write_seconds or t.stats.recent_read_seconds for t in self._tiers()))

    def stats(self, step_time_s: float = 0.0, num_batched_tokens: int = 0) -> StepStats:
        """The snapshot sent with each message: gauges now, counters as deltas since the last call
        (latency observations: those since the last call); ``num_batched_tokens`` and
        ``step_time_s`` describe the step it follows (0: no step)."""
        sched, pool = self.scheduler, self.kv_cache.block_pool
        counters = self._counters()
        before = self._reported or (0, 0, 0, (), (), (), ())
        self._reported = counters
        delta = [now - prev for now, prev in zip(counters[:3], before[:3])]
        tier_delta = []
        for now, prev in zip(counters[3:], before[3:]):
            prev_d = dict(prev)
            tier_delta.append({name: value - prev_d.get(name, 0) for name, value in now})
        tiers = self._tiers()
        pins = self._pin_snapshots()
        self._reported_pins = pins
        return StepStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         kv_used_blocks=self.capacity.num_blocks - self.kv_cache.num_free_blocks,
                         kv_cached_blocks=pool.num_cached_blocks,
                         kv_num_blocks=self.capacity.num_blocks, kv_block_size=self.capacity.block_size,
                         prefix_cache_queries=delta[0], prefix_cache_hits=delta[1], num_preemptions=delta[2],
                         num_batched_tokens=num_batched_tokens, step_time_s=step_time_s,
                         tier_queries=tier_delta[0], tier_hits=tier_delta[1],
                         tier_bytes_read=tier_delta[2], tier_bytes_written=tier_delta[3],
                         tier_usage_bytes={t.name: t.usage_bytes() for t in tiers},
                         tier_capacity_bytes={t.name: t.capacity_bytes() for t in tiers},
                         offload_write_seconds={t.name: t.stats.drain_recent("write") for t in tiers},
                         offload_read_seconds={t.name: t.stats.drain_recent("read") for t in tiers},
                         kv_pinned_blocks=self.kv_cache.num_pinned_blocks, pins=pins)

    def unpin(self, block_hash: str) -> bool:
        """Ask for a pin's release (applied by ``housekeeping`` / the next schedule); False if unknown."""
        return self.kv_cache.request_unpin(block_hash)

    # ---- the step -------------------------------------------------------------------------
    def _execute(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        if self.fault_token_id is not None and any(
                s.request.prompt_token_ids[0] == self.fault_token_id for s in plan.scheduled):
            raise RuntimeError(f"injected test fault ({FAULT_TOKEN_ENV})")
        return self.runner.execute(plan)

    def _execute_isolated(self, plan: SchedulerOutput) -> tuple[dict[str, SampledToken], list[Request]]:
        """Rerun a failed step's requests one at a time; return the samples and the requests that fail alone.

        Rerunning is exact: the failed pass wrote K/V only into the same slots the reruns write."""
        sampled: dict[str, SampledToken] = {}
        failed: list[Request] = []
        for item in plan.scheduled:
            try:
                sampled.update(self._execute(SchedulerOutput(scheduled=[item])))
            except Exception:  # noqa: BLE001 - the fault belongs to this request only
                logger.exception("engine step failed for request %s", item.request.request_id)
                failed.append(item.request)
        return sampled, failed

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, apply the sampled tokens; return per-request outputs."""
        if self.offloader is not None:
            self._finish_loads()
        outputs = self._resolve_grammars()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_batched_tokens
        if self.offloader is not None:
            # Evicted / written-through blocks still hold their contents until the forward pass.
            self.offloader.offload(self.kv_cache.take_offloads())
            for request, blocks in plan.loads:
                self.offloader.submit_load(request.request_id, blocks)
        if plan.is_empty:
            return outputs
        failed: list[Request] = []
        try:
            sampled = self._execute(plan)
        except Exception:  # noqa: BLE001 - isolate the requests that cause it
            logger.exception("engine step of %d requests failed; retrying them one by one", len(plan.scheduled))
            sampled, failed = self._execute_isolated(plan)
        if failed:
            failed_ids = {r.request_id for r in failed}
            plan.scheduled = [s for s in plan.scheduled if s.request.request_id not in failed_ids]
            for request in self.scheduler.finish_requests(list(failed_ids), RequestStatus.FINISHED_ERROR):
                outputs.append(self._final(request))
        touched = self.scheduler.update(plan, {rid: s.token_id for rid, s in sampled.items()})
        for request in touched:
            rid = request.request_id
            token = request.output_token_ids[-1]
            if request.grammar is not None and not request.status.is_finished:
                self._advance_grammar(request, token)
            finished = request.status.is_finished
            sample = sampled[rid]
            logprobs = None
            if sample.logprob is not None:
                logprobs = [TokenLogprob(token, sample.logprob, sample.top_logprobs or [])]
            prompt_logprobs = None
            if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1:
                prompt_logprobs = list(request.prompt_logprobs)
            error = request.grammar.error if request.grammar is not None and finished else None
            outputs.append(self._output(request, [token], logprobs, prompt_logprobs, error))
            if finished:
                self.runner.release(rid)
        if self.offloader is not None:  # write-throughs of requests that just finished
            self.offloader.offload(self.kv_cache.take_offloads())
        return outputs

    # ---- structured output -------------------------------------------------------------------
    def _resolve_grammars(self) -> list[EngineCoreOutput]:
        """Build the matcher of every request whose grammar finished compiling; a request whose
        grammar failed finishes here with an error (the engine goes on)."""
        outputs = []
        for rid, request in list(self._compiling.items()):
            if not request.grammar.compiled():
                continue
            del self._compiling[rid]
            if not request.grammar.resolve():
                logger.info("request %s: grammar failed: %s", rid, request.grammar.error)
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                out = self._final(request)
                out.error = f"invalid grammar: {request.grammar.error}"
                outputs.append(out)
        return outputs

    def _advance_grammar(self, request: Request, token: int) -> None:
        """Feed the sampled token to the request's matcher; finish the request when the grammar
        is complete (no EOS step needed) or, should it ever reject a token, with an error."""
        grammar = request.grammar
        if not grammar.accept(token):
            logger.warning("request %s: grammar rejected token %d: %s", request.request_id, token, grammar.error)
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        elif grammar.is_terminated and token not in request.eos_token_ids:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def housekeeping(self) -> None:
        """Between steps while idle: release expired or deleted pins (their blocks become evictable)."""
        if self.kv_cache.expire_pins() and self.offloader is not None:
            self.offloader.offload(self.kv_cache.take_offloads())

    def _finish_loads(self) -> None:
        """Apply finished tier reads; wait a little for one when nothing else could run."""
        assert self.offloader is not None
        idle = not self.scheduler.running and not self.scheduler.waiting and self.scheduler.loading
        loading = self.scheduler.loading
        for request_id, num_blocks in self.offloader.poll(timeout=0.05 if idle else 0.0,
                                                         is_live=lambda rid: rid in loading):
            self.scheduler.finish_loading(request_id, num_blocks)

    # ---- offline convenience ----------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run ``prompts`` together to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        processor = OutputProcessor(self.tokenizer)
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            rid = self.add_request(prompt, p)
            req = self.scheduler.requests[rid]
            processor.add_request(rid, req.prompt_token_ids, req.sampling_params, req.arrival_time)
            results[rid] = GenerationResult(rid, list(req.prompt_token_ids), [], "", None, 0,
                                            [] if (p and p.logprobs is not None) else None)
            order.append(rid)
        while self.has_unfinished():
            outs, stopped = processor.process(self.step())
            for rid in stopped:  # a stop string ended it: free its blocks now
                self.abort(rid, stopped=True)
            for out in outs:
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.text
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
                    res.num_cache_write_tokens = out.num_cache_write_tokens
        return [results[rid] for rid in order]
