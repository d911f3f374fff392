"""Per-tenant counters, beside the engine's families in the same registry.

``kvserve_tenant_requests_total{tenant, finished_reason}``, ``kvserve_tenant_prompt_tokens_total``
and ``kvserve_tenant_generation_tokens_total`` (counted per engine request when its response
ends, so with ``n`` choices the prompt counts ``n`` times, like ``kvserve_prompt_tokens_total``),
and ``kvserve_tenant_rejections_total{tenant, reason}`` (429s and 400s of admission: ``concurrency``,
``queue``, ``tokens``, ``too_large``, ``overloaded`` for the server-wide queue). All labelled
``model_name`` too. The ``tenant`` label takes only configured names and ``anonymous`` (bounded);
never a key or anything derived from one. A key file of more than 32 tenants exports a
tenant's series from its first request on (smaller ones from the start, as zeros). The engine's own families keep their labels, so
dashboards and ``--metrics-compat vllm`` read them as before.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter

REJECTION_REASONS = ("concurrency", "queue", "tokens", "too_large", "overloaded")
SEEDED_TENANTS = 32  # key files of at most this many tenants export zeros from the start


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tenant"]
        self.requests = Counter("tenant_requests", "Engine requests that ended, by tenant and finish reason.",
                                labels + ["finished_reason"], namespace="kvserve", registry=registry)
        self.prompt_tokens = Counter("tenant_prompt_tokens", "Prompt tokens of ended engine requests, by tenant.",
                                     labels, namespace="kvserve", registry=registry)
        self.generation_tokens = Counter("tenant_generation_tokens", "Generated tokens, by tenant.", labels,
                                         namespace="kvserve", registry=registry)
        self.rejections = Counter("tenant_rejections", "Requests refused at admission, by tenant and reason.",
                                  labels + ["reason"], namespace="kvserve", registry=registry)

    def add_tenants(self, names: Iterable[str]) -> None:
        """Export zeros for these tenants, so rate() has a baseline (only for a few: seven series
        of zeros for each of 1,000 tenants would make every scrape format 7,000 lines)."""
        names = list(names)
        if len(names) > SEEDED_TENANTS:
            return
        for name in names:
            self.prompt_tokens.labels(self.model_name, name)
            self.generation_tokens.labels(self.model_name, name)
            for reason in REJECTION_REASONS:
                self.rejections.labels(self.model_name, name, reason)

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(self.model_name, tenant, reason).inc()

    def ended(self, tenant: str, prompt_tokens: int, generated: int, finish_reason: str | None) -> None:
        self.requests.labels(self.model_name, tenant, finish_reason or "abort").inc()
        self.prompt_tokens.labels(self.model_name, tenant).inc(prompt_tokens)
        self.generation_tokens.labels(self.model_name, tenant).inc(generated)
