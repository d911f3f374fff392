"""The server's side of tenants (``Tenancy``): authenticate a request, salt and prioritise its
engine requests, admit it under its limits, and account for it when it ends.

Errors keep each route's shape (``server.errors``: a ``/v1/messages`` 429 is Anthropic's):

* 401 ``invalid_api_key``: no key, or one no tenant holds;
* 403 ``permission_denied``: the tenant's ``allow`` lacks the route's right;
* 429 ``rate_limit_exceeded`` with ``Retry-After``: over ``max_concurrent_requests`` (and its
  queue) or ``tokens_per_minute``;
* 400 naming ``max_tokens``: the request may use more tokens than the tenant's whole bucket.

No message names a key, a digest or a salt.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from server.access_log import note_tenant
from server.errors import APIError, bad_request
from server.tenants.config import SALT_PREFIX, Tenant
from server.tenants.limits import Clock, RateLimited, TenantLimiter, TooLarge
from server.tenants.metrics import TenantMetrics
from server.tenants.registry import TenantRegistry, set_current_tenant

RIGHT_NAMES = {"inference": "the inference routes", "cache_admin": "the prompt-cache admin routes (/v1/cache)",
               "metrics": "/metrics"}


class Tenancy:
    def __init__(self, api_key: str | None, api_key_file: str | None, clock: Clock = time.monotonic) -> None:
        self.registry = TenantRegistry(api_key, api_key_file)
        self.limiter = TenantLimiter(clock)
        self.metrics: TenantMetrics | None = None

    def bind_metrics(self, registry: Any, model_name: str) -> None:
        self.metrics = TenantMetrics(registry, model_name)
        self.metrics.add_tenants(self.registry.names() or ["anonymous"])

    def install_reload_signal(self) -> bool:
        return self.registry.install_reload_signal(self.reload)

    def reload(self) -> bool:
        ok = self.registry.reload()
        if ok and self.metrics is not None:
            self.metrics.add_tenants(self.registry.names())
        return ok

    # ---- who ----------------------------------------------------------------------------
    def authenticate(self, authorization: str | None, right: str = "inference") -> Tenant:
        """The tenant of ``Authorization: Bearer KEY`` (becomes the current tenant); 401 / 403."""
        scheme, _, given = (authorization or "").partition(" ")
        key = given.strip() if scheme.lower() == "bearer" else None
        tenant = self.registry.authenticate(key or None)
        if tenant is None:
            raise APIError(401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'.",
                           "invalid_request_error", None, "invalid_api_key")
        note_tenant(tenant.name)  # a 403 too: the access log says who was refused
        if right not in tenant.allow:
            raise APIError(403, f"this API key may not use {RIGHT_NAMES.get(right, right)}", "permission_error",
                           None, "permission_denied")
        set_current_tenant(tenant)
        return tenant

    def engine_tenant(self, tenant: Tenant) -> str | None:
        """The name the engine sees (fair admission, pin ownership); None without a key file."""
        return tenant.name if self.registry.uses_key_file else None

    def owns(self, tenant: Tenant, owner: str | None) -> bool:
        """Whether a pin (or stored response) owned by ``owner`` is ``tenant``'s to see."""
        return owner == self.engine_tenant(tenant)

    @staticmethod
    def check_request_salt(salt: str | None) -> None:
        if salt is not None and salt.startswith(SALT_PREFIX):
            raise bad_request(f"cache_salt may not start with {SALT_PREFIX!r} (reserved for tenant salts)",
                              "cache_salt")

    @staticmethod
    def priority(tenant: Tenant, requested: int, policy: str) -> int:
        """The engine priority of a request: ``requested``, capped by the tenant's floor; a
        non-zero request under the ``fcfs`` policy is a 400 (it would be ignored)."""
        if requested and policy != "priority":
            raise bad_request("priority needs the scheduler's 'priority' policy (scheduler.policy: priority); "
                              "this server schedules first come, first served", "priority")
        return tenant.effective_priority(requested) if policy == "priority" else 0

    # ---- limits -------------------------------------------------------------------------
    def rejected(self, tenant: Tenant, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(tenant.name, reason)

    async def admit(self, tenant: Tenant, jobs: Sequence[Any], max_model_len: int) -> None:
        """Admit one HTTP request's jobs under ``tenant``'s limits; the lease rides on the jobs."""
        most = sum(len(j.prompt_token_ids) + (j.params.max_tokens or max_model_len - len(j.prompt_token_ids))
                   for j in jobs)
        try:
            lease = await self.limiter.admit(tenant, most)
        except RateLimited as exc:
            self.rejected(tenant, exc.reason)
            raise APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except TooLarge as exc:
            self.rejected(tenant, "too_large")
            raise bad_request(str(exc), "max_tokens") from None
        for job in jobs:
            job.tenant, job.lease = tenant, lease

    def ended(self, jobs: Sequence[Any]) -> None:
        """The response of ``jobs`` ended (finished, failed or left): release and count."""
        if not jobs or jobs[0].tenant is None:
            return
        used = sum(j.choice.num_prompt_tokens + j.choice.num_output_tokens for j in jobs)
        if jobs[0].lease is not None:
            jobs[0].lease.release(used)
        if self.metrics is not None:
            for job in jobs:
                self.metrics.ended(job.tenant.name, job.choice.num_prompt_tokens, job.choice.num_output_tokens,
                                   job.choice.finish_reason)
