"""From an ``EngineConfig`` to the parts an ``LLMEngine`` runs: the one place an engine is built.

``build_engine_parts(config, loaded=None)`` resolves the device and dtype, loads the weights (or
takes ``loaded``), builds the model (one process, or tensor-parallel ranks), sizes and allocates
the KV pool (``engine.kv.pool``; on CUDA after a profiling pass, ``engine.kv.budget``), builds
the lower KV tiers (host, disk), the cache manager, the scheduler, the runner and the grammar
compiler, and returns them as one ``EngineParts``.

Order matters twice: the disk tier's fingerprint samples the weights, so it is taken before the
model consumes the loaded state dict; the host tier's slot size is the block copier's payload,
so the tiers come after the pool.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from cache import CacheConfig, KVCacheManager, KVCapacity
from cache.eviction import EvictionConfig, build_policy
from cache.tiers import DiskTier, HostTier, KVTier, TierChain
from engine.attention import resolve_backend, select_attention
from engine.attention.precision import DTYPES as PREFILL_TORCH_DTYPES, resolve_prefill_attention_dtype
from engine.config import EngineConfig, ModelConfig
from engine.core.protocol import EngineInfo
from engine.kernels import load_kernels
from engine.kv.budget import profile_kv_budget
from engine.kv.pool import kv_bytes_per_token, kv_fixed_bytes, num_blocks_for_budget
from engine.kv.transfer import KVOffloader, model_fingerprint
from engine.loader import LoadedModel, gguf_source, load_model
from engine.loader.gguf.blocks import BlockFormat
from engine.loader.gguf.reader import read_gguf_index
from engine.model.arch import ModelArch
from engine.model.block_linear import BlockLinear
from engine.model.linear import resolve_prefill_matmul_dtype
from engine.model.llama import LlamaForCausalLM, configure_linear_layers
from engine.model.native_decode import configure_decode_path
from engine.model.runner import ModelRunner
from engine.platform.host_malloc import limit_malloc_arenas
from engine.sampling.structured_output import GrammarCompiler
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    """What ``LLMEngine`` runs. ``config`` is the resolved one (``scheduler.max_model_len`` set,
    ``kv_cache_dtype`` resolved by ``resolve_kv_dtype``, ``activation_quant`` by the model's
    binding). ``offloader`` drives the
    lower tiers (None without any); ``disk_tier`` is the persistent one (None without);
    ``host_arena`` keeps the host tier's memory alive."""

    config: EngineConfig
    arch: ModelArch
    tokenizer: Any  # the HF tokenizer, or None (token-id-only models)
    model_name: str
    max_model_len: int
    runner: ModelRunner
    capacity: KVCapacity
    kv_cache: KVCacheManager
    scheduler: Scheduler
    offloader: KVOffloader | None
    disk_tier: DiskTier | None
    host_arena: torch.Tensor | None
    grammars: GrammarCompiler | None
    info: EngineInfo


def build_engine_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Build everything ``config`` asks for (``loaded``: weights already in memory, e.g. tests')."""
    return _EngineBuild(config, loaded).parts()


# ---- the steps, each a function of what it needs --------------------------------------------
def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no GPU (install a CUDA build of torch)")
    return torch.device(name)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_kv_dtype(config: EngineConfig, device: torch.device) -> EngineConfig:
    """``kv_cache_dtype`` as the pool is built: ``auto`` is ``float16`` on the CPU under a float32
    model on one rank (llama.cpp's default KV type; fp16 pools under tensor parallel ranks are
    not implemented), else the model's dtype; ``float32`` (the exact option) needs a float32
    model; a dtype equal to the model's is its own dtype, ``auto``."""
    kv, model_dtype = config.cache.kv_cache_dtype, config.model.dtype
    if kv == "auto" and device.type == "cpu" and model_dtype == "float32" and config.model.tensor_parallel_size == 1:
        kv = "float16"
    if kv == "float32" and model_dtype != "float32":
        raise ValueError(f"kv_cache_dtype 'float32' under a {model_dtype} model is not implemented; "
                         "use 'auto' (the model's dtype)")
    if kv == model_dtype:
        kv = "auto"
    if kv != config.cache.kv_cache_dtype:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=kv))
    return config


def resolve_max_len(config: EngineConfig, arch: ModelArch) -> int:
    """The context length: the model config's, else the scheduler's, else the model's own. A
    model config value that is a cap (``max_model_len_is_cap``: it came from a profile) is
    lowered to the model's context; any other value above it is an error."""
    max_len = config.model.max_model_len or config.scheduler.max_model_len or arch.max_position_embeddings
    if config.model.max_model_len_is_cap and config.model.max_model_len == max_len > arch.max_position_embeddings:
        logger.info("max_model_len %d (the profile's) is above the model's context: %d tokens", max_len,
                    arch.max_position_embeddings)
        return arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context of "
                         f"{arch.max_position_embeddings} tokens")
    return max_len


def check_cache_dtypes(config: EngineConfig) -> None:
    """Refuse the KV dtype settings the engine does not implement."""
    cache_cfg = config.cache
    if cache_cfg.cache_dtype is not None and cache_cfg.cache_dtype != config.model.dtype:
        raise ValueError(f"cache_dtype {cache_cfg.cache_dtype} differs from the model dtype {config.model.dtype}: "
                         "a KV dtype of its own is not implemented (leave cache_dtype unset; kv_cache_dtype "
                         "int8 quantizes the pool)")
    if cache_cfg.kv_cache_dtype == "int4":
        if config.model.tensor_parallel_size > 1:
            raise ValueError("kv_cache_dtype 'int4' is not implemented with tensor_parallel_size > 1; use 'int8'")
        if config.scheduler.speculative_config is not None:
            # A rejected draft may roll a sequence back into a block its drafts completed and quantized.
            raise ValueError("kv_cache_dtype 'int4' is not implemented with speculative_config; use 'int8'")


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


def build_ranked_model(config: EngineConfig, loaded: LoadedModel, max_len: int, dtype: torch.dtype,
                       device: torch.device, attention_backend: str) -> Any:
    """The model split over ``tensor_parallel_size`` ranks (engine/parallel: this process is rank 0)."""
    cache_cfg = config.cache
    if cache_cfg.kv_cache_dtype == "float16":
        raise ValueError("kv_cache_dtype 'float16' under a float32 model is not implemented with "
                         "tensor_parallel_size > 1; use 'auto' or 'int8'")
    if config.model.activation_quant == "int8":
        raise ValueError("activation_quant 'int8' runs on GGUF blocks, which tensor parallel ranks do not "
                         "use; use activation_quant 'none'")
    from engine.parallel.tensor_parallel import launch

    model = launch(
        loaded.arch, loaded.hf_config, loaded.state_dict, config.model.tensor_parallel_size, max_len,
        attention_backend, config.model.linear_backend, dtype,
        config.model.num_threads or available_cores(), device, cache_cfg.block_size)
    loaded.state_dict.clear()
    return model


def build_local_model(config: EngineConfig, loaded: LoadedModel, max_len: int, dtype: torch.dtype,
                      device: torch.device, attention_backend: str) -> LlamaForCausalLM:
    """The model in this process, its weights loaded and its linear layers bound."""
    cache_cfg = config.cache
    model = build_model(loaded, max_len, dtype, device)
    model.attn = select_attention(attention_backend, device, dtype, cache_cfg.block_size,
                                  cache_cfg.kv_cache_dtype)
    model.load_hf_state_dict(loaded.state_dict, loaded.blocks)
    model.eval()
    loaded.state_dict.clear()  # weights now live in the fused parameters only
    if loaded.blocks is not None:
        loaded.blocks.clear()  # and the blocks in the model's BlockMatrix groups
    model.activation_quant = config.model.activation_quant
    _select_linear(model, loaded, config.model.linear_backend, device, dtype)
    return model


def pool_bytes_per_token(config: EngineConfig, arch: ModelArch, model: Any, dtype: torch.dtype,
                         device: torch.device) -> int:
    """What one token of the pool costs in the budget the pool is sized from: a GPU's budget
    holds one rank's pool (its own KV heads), host memory holds all ranks' pools."""
    kv_cache_dtype = config.cache.kv_cache_dtype
    kv_heads = model.arch.num_kv_heads if device.type == "cuda" else arch.num_kv_heads
    per_token = kv_bytes_per_token(arch.num_layers, kv_heads, arch.head_dim, kv_cache_dtype, dtype,
                                   config.cache.block_size)
    if kv_cache_dtype in ("int8", "int4"):
        full = kv_bytes_per_token(arch.num_layers, kv_heads, arch.head_dim, "auto", dtype)
        logger.info("%s KV blocks: %d bytes/token instead of %d (%.2fx the tokens in the same budget)",
                    kv_cache_dtype, per_token, full, full / per_token)
    return per_token


def build_runner(config: EngineConfig, model: Any, dtype: torch.dtype, device: torch.device,
                 per_token: int) -> tuple[ModelRunner, int]:
    """The runner with its pool, and the pool's block count: ``num_blocks`` when set; on CUDA
    what the memory left after a profiling pass at the largest step holds; else what
    ``kv_cache_memory_gib`` holds."""
    cache_cfg, sched = config.cache, config.scheduler
    kv, arch = cache_cfg.kv_cache_dtype, model.arch
    # int4's residual (open blocks in the model's dtype) comes off the budget first (engine/kv/pool.py).
    fixed = kv_fixed_bytes(kv, sched.max_num_seqs, cache_cfg.block_size, arch.num_layers, arch.num_kv_heads,
                           arch.head_dim, dtype)
    if cache_cfg.num_blocks:
        num_blocks = cache_cfg.num_blocks
        runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device, kv, sched.max_num_seqs)
    elif device.type == "cuda":
        # Profile with a pool just big enough for the largest step, then size the real one.
        runner = ModelRunner(model, 1, cache_cfg.block_size, dtype, device, kv, sched.max_num_seqs)
        tokens, seqs = sched.max_num_batched_tokens, sched.max_num_seqs
        runner.allocate_kv(runner.profile_blocks(tokens, seqs))
        profile = profile_kv_budget(device, config.model.gpu_memory_utilization,
                                    lambda: runner.profile_run(tokens, seqs))
        runner.allocate_kv(0)
        logger.info(profile.describe())
        # The profiling pool measured above held a residual (`fixed`) already, which the real pool replaces.
        num_blocks = num_blocks_for_budget(profile.kv_budget + fixed, cache_cfg.block_size, per_token, fixed)
        if num_blocks == 0:
            raise ValueError("no GPU memory is left for the KV cache after loading the model: raise "
                             "--gpu-memory-utilization or lower --max-num-batched-tokens")
        runner.allocate_kv(num_blocks)
    else:
        num_blocks = num_blocks_for_budget(int(cache_cfg.kv_cache_memory_gib * 2**30), cache_cfg.block_size,
                                           per_token, fixed)
        runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device, kv, sched.max_num_seqs)
    return runner, num_blocks


def make_disk_tier(cache_cfg: CacheConfig, loaded: LoadedModel, dtype: str, arch: ModelArch) -> DiskTier | None:
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


def make_host_tier(cache_cfg: CacheConfig, block_bytes: int,
                   device: torch.device) -> tuple[HostTier | None, torch.Tensor | None]:
    """The host tier when ``kv_offload_gib`` > 0, and its arena of whole block payloads, pinned
    when the pool is on a GPU (the caller keeps the arena tensor alive as long as the tier)."""
    if cache_cfg.kv_offload_gib <= 0 or not cache_cfg.enable_prefix_caching:
        return None, None
    slots = int(cache_cfg.kv_offload_gib * 2**30) // block_bytes
    if slots == 0:
        raise ValueError(f"kv_offload_gib={cache_cfg.kv_offload_gib} does not hold one KV block "
                         f"({block_bytes} bytes)")
    pinned = device.type == "cuda"
    arena = torch.empty(slots * block_bytes, dtype=torch.uint8, pin_memory=pinned)
    host = HostTier(block_bytes, memoryview(arena.numpy()))
    if pinned:
        logger.info("KV host tier: %.2f GiB of pinned host memory, %d blocks", cache_cfg.kv_offload_gib, slots)
    else:
        logger.warning("KV host tier: %.2f GiB, %d blocks, in ordinary host memory; the KV pool is on the %s "
                       "already, so this tier duplicates host memory (useful for tests and configuration; on a "
                       "CPU server prefer a larger pool or the disk tier)", cache_cfg.kv_offload_gib, slots,
                       device.type)
    return host, arena


def chain_tiers(host: HostTier | None, disk: DiskTier | None) -> KVTier | None:
    """The lower tiers as the one tier the cache manager and the offloader see (host -> disk)."""
    if host is None:
        return disk
    return TierChain([host, disk]) if disk is not None else host


def resolve_eviction(config: EngineConfig) -> EvictionConfig:
    """``--kv-eviction`` against the resolved context and step budget; ValueError for what it
    cannot run with (speculative decoding rolls back slots by text position; tensor-parallel
    ranks would each need the re-rotations; int4 keys are quantized per channel across a block,
    so a re-rotation would have to requantize whole blocks, which is not implemented)."""
    eviction = config.cache.eviction.resolve(config.scheduler.max_model_len, config.scheduler.max_num_batched_tokens)
    if eviction.enabled:
        if config.scheduler.speculative_config is not None:
            raise ValueError(f"kv_eviction {eviction.policy!r} does not run with speculative decoding")
        if config.model.tensor_parallel_size > 1:
            raise ValueError(f"kv_eviction {eviction.policy!r} does not run with tensor_parallel_size > 1")
        if config.cache.kv_cache_dtype == "int4":
            raise ValueError(f"kv_eviction {eviction.policy!r} does not run with kv_cache_dtype int4 "
                             "(re-rotating keys quantized per channel is not implemented)")
        if eviction.policy == "h2o":
            logger.info("KV eviction: h2o, a %d-block budget: %d sink blocks, the last %d tokens and the heaviest "
                        "blocks by accumulated attention (a sequence holds at most %d tokens)", eviction.budget_blocks,
                        eviction.sink_blocks, eviction.recent_tokens, eviction.max_held_tokens)
        else:
            logger.info("KV eviction: %s, %d sink blocks + a %d-token window (a sequence holds at most %d tokens)",
                        eviction.policy, eviction.sink_blocks, eviction.window_tokens, eviction.max_held_tokens)
    return eviction


def engine_info(config: EngineConfig, model_name: str, arch: ModelArch, capacity: KVCapacity,
                kv_cache: KVCacheManager, has_tokenizer: bool, has_disk_tier: bool,
                eviction: EvictionConfig | None = None) -> EngineInfo:
    cache_cfg = config.cache
    evicting = eviction is not None and eviction.enabled
    return EngineInfo(model_name=model_name, max_model_len=config.scheduler.max_model_len,
                      vocab_size=arch.vocab_size, block_size=cache_cfg.block_size, num_blocks=capacity.num_blocks,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                      dtype=config.model.dtype, enable_prefix_caching=cache_cfg.enable_prefix_caching,
                      has_tokenizer=has_tokenizer, has_disk_tier=has_disk_tier,
                      kv_bytes_per_token=capacity.bytes_per_token, kv_cache_dtype=cache_cfg.kv_cache_dtype,
                      max_pinned_blocks=kv_cache.max_pinned_blocks, scheduling_policy=config.scheduler.policy,
                      kv_eviction=eviction.policy if evicting else "none",
                      kv_max_request_tokens=eviction.max_request_tokens if evicting else None,
                      kv_max_held_tokens=eviction.max_held_tokens if evicting else 0)


class _EngineBuild:
    """The steps in order; each reads what the ones before it set."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.config = config
        self.loaded = loaded

    def parts(self) -> EngineParts:
        limit_malloc_arenas()  # before the load and the first OpenMP region (engine/platform/host_malloc.py)
        config = self.config
        torch.set_num_threads(config.model.num_threads or available_cores())
        device = resolve_device(config.model.device)
        config = resolve_kv_dtype(config, device)
        dtype = DTYPES[config.model.dtype]
        loaded = self.loaded or load_model(config.model.model, dtype, _blocks_only(config.model, dtype))
        arch = loaded.arch
        max_len = resolve_max_len(config, arch)
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_model_len=max_len))
        self.config = config
        cache_cfg = config.cache
        # Resolved here, once, so that every tensor-parallel rank builds the same backend; with an
        # int8 pool ``auto`` passes over the backends that read float pools only (flash_attn).
        attention_backend = resolve_backend(config.model.attention_backend, device, dtype,
                                            cache_cfg.block_size, cache_cfg.kv_cache_dtype)
        disk = make_disk_tier(cache_cfg, loaded, config.model.dtype, arch)  # samples the weights: before the model
        check_cache_dtypes(config)
        build = build_ranked_model if config.model.tensor_parallel_size > 1 else build_local_model
        model = build(config, loaded, max_len, dtype, device, attention_backend)
        # auto, as the model resolved it (tensor parallel ranks run no block matmuls: none)
        activation_quant = getattr(model, "activation_quant", "none")
        prefill_attention = resolve_prefill_attention_dtype(
            config.model.prefill_attention_dtype, device, dtype, activation_quant, config.model.tensor_parallel_size)
        model.attn.prefill_dtype = PREFILL_TORCH_DTYPES[prefill_attention]
        prefill_matmul = resolve_prefill_matmul_dtype(
            config.model.prefill_matmul_dtype, device, dtype, activation_quant, config.model.tensor_parallel_size)
        model.set_prefill_matmul_dtype(prefill_matmul)
        if model.block_linears():
            logger.info("Prefill matmuls: %s", model.describe_prefill_matmuls())
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, activation_quant=activation_quant, prefill_attention_dtype=prefill_attention,
            prefill_matmul_dtype=prefill_matmul))
        self.config = config
        logger.info("Attention: %s on %s (%s%s%s)", model.attn.describe(), device, config.model.dtype,
                    "" if cache_cfg.kv_cache_dtype == "auto" else f", {cache_cfg.kv_cache_dtype} KV blocks",
                    f", prefill chunks attend in {prefill_attention} on {model.attn.prefill_kernel(arch.head_dim)}"
                    if device.type == "cpu" else "")
        _select_decode_path(model, config.model.decode_path, cache_cfg.kv_cache_dtype)

        per_token = pool_bytes_per_token(config, arch, model, dtype, device)
        self.runner, num_blocks = build_runner(config, model, dtype, device, per_token)
        capacity = KVCapacity(num_blocks=num_blocks, block_size=cache_cfg.block_size, bytes_per_token=per_token)
        logger.info(capacity.describe(max_len))
        sched = config.scheduler
        # Not with tensor parallelism: each step starts with a host-side broadcast to the other ranks.
        if (config.model.cuda_graphs and config.model.tensor_parallel_size == 1
                and self.runner.capture_cuda_graphs(sched.max_num_seqs, max_len)):
            logger.info("Decode steps replay CUDA graphs (batch sizes up to %d)", sched.max_num_seqs)

        # With tensor parallelism a block's K/V is spread over the ranks: the copier gathers it.
        copier = self.runner.model.block_copier(self.runner.kv_caches)
        host, arena = make_host_tier(cache_cfg, copier.payload_bytes, device)
        tier = chain_tiers(host, disk)
        eviction = resolve_eviction(config)
        policy = build_policy(eviction)
        if policy is not None and policy.needs_block_mass:
            attn = self.runner.model.attn
            if not attn.exports_block_mass:
                raise ValueError(f"kv_eviction {eviction.policy!r} needs the attention mass per block, and "
                                 f"attention_backend {attn.name!r} cannot give it: {attn.block_mass_refusal}")
            self.runner.export_block_mass = True
        kv_cache = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching,
                                  tier=tier, pin_fraction=cache_cfg.kv_pin_fraction, eviction=policy)
        if self.runner.kv_residual is not None:  # int4: reclaim open blocks that went back to the pool
            blocks = kv_cache.block_pool.blocks
            self.runner.kv_residual.block_in_use = lambda b: b < len(blocks) and blocks[b].ref_cnt > 0
        tokenizer = loaded.tokenizer
        model_name = config.model.served_model_name or loaded.name
        # drafts are verified on the native decode path while a step fits in its rows
        native = self.runner.model.native
        verify_rows = native.max_rows if native is not None else None
        return EngineParts(
            config=config, arch=arch, tokenizer=tokenizer, model_name=model_name, max_model_len=max_len,
            runner=self.runner, capacity=capacity, kv_cache=kv_cache,
            scheduler=Scheduler(sched, kv_cache, verify_row_budget=verify_rows),
            offloader=KVOffloader(tier, copier) if tier is not None else None, disk_tier=disk, host_arena=arena,
            # Structured output: grammars compile on the compiler's thread.
            grammars=GrammarCompiler(tokenizer, arch.vocab_size) if tokenizer is not None else None,
            info=engine_info(config, model_name, arch, capacity, kv_cache, tokenizer is not None, disk is not None,
                             eviction))


# ---- choices made once at build time, each with its log line --------------------------------
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
    if not (runnable and torch.ops.kvserve.gguf_kernel_isa() == "avx2"):
        return False
    if gguf.stat().st_size > cfg.blocks_auto_file_gib * 2**30:
        return True
    # a small file keeps a dense copy for a faster prefill, unless int8 activations run every
    # call of its matrices on the blocks anyway (an int8 prefill kernel for each format): the copy
    # would never be read
    return cfg.activation_quant != "none" and BlockLinear.dense_copy_unread(_matrix_formats(gguf))


def _matrix_formats(path) -> set[BlockFormat | None]:
    """The formats of a GGUF file's matrices (2-D tensors); a matrix in a format the kernels do not
    read counts as None."""
    return {BlockFormat.from_ggml(t.ggml_type) for t in read_gguf_index(path).tensors if len(t.shape) == 2}


def _select_linear(model: LlamaForCausalLM, loaded: LoadedModel, backend: str, device: torch.device,
                   dtype: torch.dtype) -> None:
    """Attach the GGUF blocks where they may run, bind the matmuls, log (engine/model/linear.py)."""
    configure_linear_layers(model, loaded, backend, device, dtype, logger)


def _select_decode_path(model: LlamaForCausalLM, choice: str, kv_cache_dtype: str) -> None:
    """The decode path (``ModelConfig.decode_path``), chosen and logged (engine/model/native_decode.py)."""
    configure_decode_path(model, choice, kv_cache_dtype, logger)
