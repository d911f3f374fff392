"""Tenants: per-key identity, an isolated prefix cache, limits and priority.

Contract (each module says its part):

* ``config``: the key file (``--api-key-file``, YAML) parsed into immutable ``Tenant`` values;
  keys are held only as sha256 digests.
* ``registry``: API key -> tenant in constant time per request (a dict lookup on the digest,
  ``hmac.compare_digest`` on the match), the current tenant of a request (a context variable
  set by the auth dependency), and the atomic reload on SIGHUP.
* ``limits``: per-tenant concurrency slots, their queue, and a tokens-per-minute bucket with an
  injectable clock.
* ``admission``: ``Tenancy``, what the serving layer calls: authenticate (401/403), the
  request's salt and priority, admission (429 with ``Retry-After``), and accounting at the end.
* ``metrics``: the ``kvserve_tenant_*`` counters (bounded label values, never a key).

Isolation: every engine request of a tenant carries the tenant's salt before the request's own
``cache_salt`` (``Tenant.cache_salt``), so its prefix-cache hash chain, and so its pins and
disk-tier files, are its own; the engine also gets the tenant's name, which owns its pins
(``/v1/cache`` lists and deletes only the caller's) and drives round-robin admission
(scheduler/fairness.py). Without a key file every request is the ``anonymous`` tenant, unsalted,
as before tenants existed. Nothing here logs, returns or exports a key, a digest or a salt.
"""
from server.tenants.admission import Tenancy
from server.tenants.config import ANONYMOUS, KeyFileError, Tenant, load_key_file, parse_key_file
from server.tenants.registry import TenantRegistry, current_tenant

__all__ = ["ANONYMOUS", "KeyFileError", "Tenancy", "Tenant", "TenantRegistry", "current_tenant", "load_key_file",
           "parse_key_file"]
