"""The synchronous engine: requests in, one scheduled forward pass per ``step()``, outputs out.

It is driven by one thread only: the engine core's loop (``engine/core.py``, in its own
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

from cache import CacheConfig, KVCacheManager
from engine.attention import make_attention
from engine.config import EngineCoreConfig, ModelConfig
from engine.core_protocol import EngineCoreOutput, EngineInfo, PromptTooLongError, StepStats  # noqa: F401 (re-export)
from engine.kernels import load_kernels
from engine.loader import LoadedModel, load_model
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner, SampledToken
from engine.output_processor import OutputProcessor
from engine.quant import gguf_blocks
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
        loaded = loaded or load_model(config.model.model, dtype)
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
        model.load_hf_state_dict(loaded.state_dict)
        model.to(device).eval()
        loaded.state_dict.clear()  # weights now live in the fused parameters only
        self._select_linear(model, loaded, config.model.linear_backend, device, dtype)

        cache_cfg = config.cache
        if cache_cfg.cache_dtype is not None and cache_cfg.cache_dtype != config.model.dtype:
            raise ValueError(f"cache_dtype {cache_cfg.cache_dtype} differs from the model dtype {config.model.dtype}: "
                             "a KV dtype of its own is not implemented (leave cache_dtype unset)")
        self.capacity = cache_cfg.capacity(arch.num_layers, arch.num_kv_heads, arch.head_dim, config.model.dtype)
        num_blocks = self.capacity.num_blocks
        logger.info(self.capacity.describe(max_len))

        self.kv_cache = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache)
        self.runner = ModelRunner(model, num_blocks, cache_cfg.block_size, dtype, device)
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens run by the latest step (for the iteration_tokens metric)
        self.info = EngineInfo(model_name=self.model_name, max_model_len=max_len, vocab_size=arch.vocab_size,
                               block_size=cache_cfg.block_size, num_blocks=num_blocks,
                               max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
                               dtype=config.model.dtype, enable_prefix_caching=cache_cfg.enable_prefix_caching)
        fault = os.environ.get(FAULT_TOKEN_ENV)
        self.fault_token_id: int | None = int(fault) if fault else None
        self._reported = (0, 0, 0)  # scheduler counters at the previous stats snapshot

    @staticmethod
    def _select_linear(model: LlamaForCausalLM, loaded: LoadedModel, backend: str, device: torch.device,
                       dtype: torch.dtype) -> None:
        """Attach the GGUF blocks when the gguf backend may run (CPU, fp32, kernels built; for
        ``auto`` also the kernel's AVX2 path, its portable loop being slower than dense fp32),
        then bind the matmuls."""
        runnable = loaded.gguf_path is not None and device.type == "cpu" and dtype == torch.float32 and load_kernels()
        fast = runnable and torch.ops.kvserve.gguf_kernel_isa() == "avx2"
        if (backend == "gguf" and runnable) or (backend == "auto" and fast):
            covered = model.attach_blocks(gguf_blocks(loaded.gguf_path, loaded.path, loaded.arch))
            logger.info("GGUF blocks kept for %d weight matrices (decode matmuls read them, %s kernel)", covered,
                        torch.ops.kvserve.gguf_kernel_isa())
        chosen = model.select_linear_backend(backend)
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
        return request_id

    def validate_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.info.validate(prompt_ids, params)

    def abort(self, request_id: str) -> EngineCoreOutput | None:
        """Free a live request's blocks now; returns its final output, or None if it was not live."""
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return None
        return self._final(request)

    def abort_all(self, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[EngineCoreOutput]:
        live = list(self.scheduler.requests)
        return [self._final(request) for request in self.scheduler.finish_requests(live, status)]

    def _final(self, request: Request) -> EngineCoreOutput:
        self.runner.release(request.request_id)
        return self._output(request, [])

    @staticmethod
    def _output(request: Request, new_token_ids: list[int],
                logprobs: list[TokenLogprob] | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=request.request_id, new_token_ids=new_token_ids,
                                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                logprobs=logprobs, num_prompt_tokens=request.num_prompt_tokens,
                                num_cached_tokens=max(request.num_cached_tokens, 0),
                                first_scheduled_time=request.first_scheduled_time)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self, step_time_s: float = 0.0, num_batched_tokens: int = 0) -> StepStats:
        """The snapshot sent with each message: gauges now, counters as deltas since the last call;
        ``num_batched_tokens`` and ``step_time_s`` describe the step it follows (0: no step)."""
        sched, pool = self.scheduler, self.kv_cache.block_pool
        counters = (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits, sched.stats.num_preemptions)
        delta = [now - before for now, before in zip(counters, self._reported)]
        self._reported = counters
        return StepStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         kv_used_blocks=self.capacity.num_blocks - self.kv_cache.num_free_blocks,
                         kv_cached_blocks=sum(1 for b in pool.cached_blocks.values() if b.ref_cnt == 0),
                         kv_num_blocks=self.capacity.num_blocks, kv_block_size=self.capacity.block_size,
                         prefix_cache_queries=delta[0], prefix_cache_hits=delta[1], num_preemptions=delta[2],
                         num_batched_tokens=num_batched_tokens, step_time_s=step_time_s)

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
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_batched_tokens
        if plan.is_empty:
            return []
        failed: list[Request] = []
        try:
            sampled = self._execute(plan)
        except Exception:  # noqa: BLE001 - isolate the requests that cause it
            logger.exception("engine step of %d requests failed; retrying them one by one", len(plan.scheduled))
            sampled, failed = self._execute_isolated(plan)
        outputs = []
        if failed:
            failed_ids = {r.request_id for r in failed}
            plan.scheduled = [s for s in plan.scheduled if s.request.request_id not in failed_ids]
            for request in self.scheduler.finish_requests(list(failed_ids), RequestStatus.FINISHED_ERROR):
                outputs.append(self._final(request))
        touched = self.scheduler.update(plan, {rid: s.token_id for rid, s in sampled.items()})
        for request in touched:
            rid = request.request_id
            token = request.output_token_ids[-1]
            sample = sampled[rid]
            logprobs = None
            if sample.logprob is not None:
                logprobs = [TokenLogprob(token, sample.logprob, sample.top_logprobs or [])]
            outputs.append(self._output(request, [token], logprobs))
            if request.status.is_finished:
                self.runner.release(rid)
        return outputs

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
                self.abort(rid)
            for out in outs:
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.text
                if out.logprobs and res.logprobs is not None:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in order]
