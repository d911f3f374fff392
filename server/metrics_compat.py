"""``--metrics-compat vllm``: vLLM's metric names next to the ``kvserve_`` ones, for routers.

Routers and schedulers that pick a replica by its load or its KV cache read vLLM's names
(docs/deployment.md, "Router-readable metrics", says which reader reads which):

- the Kubernetes Gateway API Inference Extension's endpoint picker (EPP; llm-d's inference
  scheduler is built on it): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc`` (older releases: ``vllm:gpu_cache_usage_perc``),
  ``vllm:lora_requests_info`` and ``vllm:cache_config_info`` (``block_size``,
  ``num_gpu_blocks``, for its prefix-cache scorer);
- vLLM's production-stack router (``vllm-router``): the two queue gauges, the KV usage gauge
  and the prefix-cache counters ``vllm:prefix_cache_queries_total`` /
  ``vllm:prefix_cache_hits_total`` (older releases: ``vllm:gpu_prefix_cache_*``);
- dashboards and autoscalers built for vLLM (llm-d's, KEDA rules): token counters, the
  latency histograms and the speculative-decoding counters (``vllm:spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``).

Contract: every ``vllm:`` family is a renamed copy of a ``kvserve_`` family *taken from the
same collection pass* of the kvserve registry, so within one scrape the two always hold equal
values; there is no second bookkeeping that could drift. The only derived family is
``vllm:lora_requests_info``, which states that no LoRA adapter is loaded (kvserve has none),
so that readers that insist on it find a well-formed answer.

This module reads nothing but the registry it wraps; where kvserve's families come from
(engine stats snapshots, scrape-time collectors) is server/metrics.py's business.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client.metrics_core import Metric

KVSERVE_PREFIX = "kvserve_"
VLLM_PREFIX = "vllm:"

# kvserve family (without the namespace) -> the vLLM family names that carry the same value.
# Counters are named here without "_total", as prometheus_client names counter families.
VLLM_FAMILIES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "cache_config": ("cache_config",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}
# vLLM's cache_config_info calls the device pool's size num_gpu_blocks (whatever the device).
CACHE_CONFIG_LABELS = {"num_blocks": "num_gpu_blocks"}
COMPAT_MODES = ("vllm",)


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def _renamed(family: Metric, new_name: str) -> Metric:
    """A copy of ``family`` under ``new_name``; sample names keep their suffixes (_total, _bucket, _info)."""
    out = Metric(new_name, family.documentation, family.type, family.unit)
    old = family.name
    for s in family.samples:
        assert s.name.startswith(old), (s.name, old)
        labels = s.labels
        if family.type == "info":
            labels = {CACHE_CONFIG_LABELS.get(k, k): v for k, v in labels.items()}
        out.add_sample(new_name + s.name[len(old):], labels, s.value, s.timestamp, s.exemplar)
    return out


def _lora_info(model_labels: dict[str, str]) -> Metric:
    """vLLM's LoRA gauge (value: the time of the reading) saying no adapter is loaded or requested."""
    family = Metric(f"{VLLM_PREFIX}lora_requests_info", "Running stats on LoRA requests (kvserve serves none).",
                    "gauge")
    family.add_sample(f"{VLLM_PREFIX}lora_requests_info",
                      {**model_labels, "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""},
                      time.time())
    return family


class VllmCompatExposition:
    """Everything ``source`` exposes, then the vLLM-named copies, from one collection pass.

    Hand it to ``prometheus_client.generate_latest`` in place of the registry.
    """

    def __init__(self, source: Collector) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        copies: list[Metric] = []
        model_labels: dict[str, str] = {}
        for family in self.source.collect():
            yield family
            if not family.name.startswith(KVSERVE_PREFIX):
                continue
            short = family.name[len(KVSERVE_PREFIX):]
            for alias in VLLM_FAMILIES.get(short, ()):
                copies.append(_renamed(family, VLLM_PREFIX + alias))
            if short == "num_requests_running" and family.samples:
                model_labels = {k: v for k, v in family.samples[0].labels.items() if k == "model_name"}
        yield from copies
        yield _lora_info(model_labels)


def enable(metrics: object, mode: str | None) -> None:
    """Make ``metrics`` (a ``server.metrics.Metrics``) expose the ``mode`` names too; ``None``: nothing.

    ``metrics.exposition`` is what its ``/metrics`` route serializes; it must be set before
    the first scrape.
    """
    if mode is None:
        return
    if mode not in COMPAT_MODES:
        raise ValueError(f"metrics_compat must be one of {list(COMPAT_MODES)} or null, got {mode!r}")
    metrics.exposition = VllmCompatExposition(metrics.registry)
