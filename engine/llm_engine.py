"""The synchronous engine: requests in, one scheduled forward pass per ``step()``, outputs out.

It is driven by one thread only (the CLI directly, or the engine loop of ``AsyncEngine``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cache import CacheConfig, KVCacheManager, KVCapacity, kv_bytes_per_token, num_blocks_for_memory
from engine.attention import make_attention
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kernels import load_kernels
from engine.loader import LoadedModel, gguf_source, load_model
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner
from engine.quant import gguf_blocks
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_prompt
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """Prompt (plus requested output) does not fit the context or the KV pool."""


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None


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


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        torch.set_num_threads(config.model.num_threads or available_cores())
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
        if config.model.attention_backend == "flash_attn":
            # Not shipped yet: it needs a GPU to be tested against the torch backend.
            raise ValueError("attention_backend 'flash_attn' is not available yet; 'torch' (SDPA over the "
                             "paged pool) runs on CUDA as well")
        model = LlamaForCausalLM(arch, loaded.hf_config, max_len).to(dtype)
        model.attn = make_attention(config.model.attention_backend, device, dtype)
        logger.info("Attention: %s", "native paged decode kernel + SDPA prefill" if model.attn.native_decode
                    else "torch SDPA")
        model.load_hf_state_dict(loaded.state_dict, loaded.blocks)
        model.to(device).eval()
        loaded.state_dict.clear()  # weights now live in the fused parameters only
        if loaded.blocks is not None:
            loaded.blocks.clear()  # and the blocks in the model's BlockMatrix groups
        self._select_linear(model, loaded, config.model.linear_backend, device, dtype)

        cache_cfg = config.cache
        per_token = kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim,
                                       torch.empty((), dtype=dtype).element_size())
        num_blocks = cache_cfg.num_blocks or num_blocks_for_memory(
            int(cache_cfg.kv_cache_memory_gib * 2**30), cache_cfg.block_size, per_token)
        self.capacity = KVCapacity(num_blocks=num_blocks, block_size=cache_cfg.block_size, bytes_per_token=per_token)
        logger.info(self.capacity.describe(max_len))

        self.kv_cache = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache)
        self.runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device)
        self._detokenizers: dict[str, IncrementalDetokenizer | None] = {}
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens run by the latest step (for the iteration_tokens metric)

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
        """Attach the GGUF blocks when the gguf backend may run (CPU, fp32, kernels built; for
        ``auto`` also the kernel's AVX2 path, its portable loop being slower than dense fp32),
        then bind the matmuls. A blocks-only model got its blocks at load."""
        runnable = loaded.gguf_path is not None and device.type == "cpu" and dtype == torch.float32 and load_kernels()
        fast = runnable and torch.ops.kvserve.gguf_kernel_isa() == "avx2"
        if loaded.blocks is None and ((backend == "gguf" and runnable) or (backend == "auto" and fast)):
            covered = model.attach_blocks(gguf_blocks(loaded.gguf_path, loaded.path, loaded.arch))
            logger.info("GGUF blocks kept for %d weight matrices (decode matmuls read them, %s kernel)", covered,
                        torch.ops.kvserve.gguf_kernel_isa())
        chosen = model.select_linear_backend(backend)
        held = model.weight_bytes()
        logger.info("Weights resident: %.0f MB blocks, %.0f MB dense%s", held["blocks"] / 1e6, held["dense"] / 1e6,
                    " (blocks only: prefill decodes tiles of the blocks)" if model.holds_blocks_only() else "")
        logger.info("Linear layers: %s (decode streams %.0f MB of weights per step)", chosen,
                    model.decode_weight_bytes() / 1e6)

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
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
                                          if self.tokenizer is not None else None)
        return request_id

    def validate_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.arch.vocab_size})")
        if n >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens but the context length is {self.max_model_len} "
                                     "tokens (at least one must be left to generate)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n + params.max_tokens} "
                f"were requested ({n} in the prompt, {params.max_tokens} to generate)")
        need = n + (params.max_tokens or self.max_model_len - n)
        if math.ceil(need / self.capacity.block_size) > self.capacity.num_blocks:
            raise PromptTooLongError(
                f"the request needs up to {need} tokens of KV cache but the pool holds only "
                f"{self.capacity.num_tokens} ({self.capacity.num_blocks} blocks); raise --num-blocks or "
                "--kv-cache-memory, or ask for fewer tokens")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free a live request's blocks now; returns its final output, or None if it was not live."""
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return None
        return self._final(request)

    def abort_all(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED, error: str | None = None) -> list[RequestOutput]:
        live = list(self.scheduler.requests)
        outputs = []
        for request in self.scheduler.finish_requests(live, status):
            out = self._final(request)
            out.error = error
            outputs.append(out)
        return outputs

    def _final(self, request: Request) -> RequestOutput:
        self.runner.release(request.request_id)
        detok = self._detokenizers.pop(request.request_id, None)
        return RequestOutput(request_id=request.request_id, new_token_ids=[],
                             text=detok.take_delta(finished=True) if detok else "", finished=True,
                             finish_reason=request.status.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens,
                             num_cached_tokens=max(request.num_cached_tokens, 0),
                             arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, apply the sampled tokens; return per-request outputs."""
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_batched_tokens
        if plan.is_empty:
            return []
        sampled = self.runner.execute(plan)
        touched = self.scheduler.update(plan, {rid: s.token_id for rid, s in sampled.items()})
        outputs = []
        for request in touched:
            rid = request.request_id
            token = request.output_token_ids[-1]
            detok = self._detokenizers.get(rid)
            if detok is not None and detok.add_token(token) is not None:
                request.stop_reason = detok.stopped_on
                if not request.status.is_finished:
                    self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                else:
                    request.status = RequestStatus.FINISHED_STOPPED
            finished = request.status.is_finished
            sample = sampled[rid]
            logprobs = None
            if sample.logprob is not None:
                logprobs = [TokenLogprob(token, sample.logprob, sample.top_logprobs or [])]
            outputs.append(RequestOutput(
                request_id=rid, new_token_ids=[token],
                text=detok.take_delta(finished) if detok is not None else "",
                finished=finished, finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0), logprobs=logprobs,
                arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time))
            if finished:
                self._detokenizers.pop(rid, None)
                self.runner.release(rid)
        return outputs

    # ---- offline convenience ----------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run ``prompts`` together to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p in zip(prompts, params_list):
            rid = self.add_request(prompt, p)
            req = self.scheduler.requests[rid]
            results[rid] = GenerationResult(rid, list(req.prompt_token_ids), [], "", None, 0,
                                            [] if (p and p.logprobs is not None) else None)
            order.append(rid)
        while self.has_unfinished():
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids.extend(out.new_token_ids)
                res.text += out.text
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in order]
