"""The key file (``--api-key-file``): YAML in, immutable ``Tenant`` values out.

Format (a mapping with one key, ``tenants``, a list)::

    tenants:
      - name: team-a                      # [A-Za-z0-9_.-]{1,64}, unique; the metrics label
        keys: ["sk-team-a-1", "sha256:9f86d0...0a08"]   # plain, or sha256 hex of the key
        max_concurrent_requests: 4        # optional: requests in flight at once
        max_queued_requests: 8            # optional (needs the one above): waiting for a slot
        tokens_per_minute: 200000         # optional: prompt + generated, a token bucket
        priority: 0                       # optional: the lowest (best) priority it may ask for
        cache_salt: "..."                 # optional: default derived from the name
        allow: [inference, cache_admin]   # optional; the default shown; also: metrics

Errors name the tenant and the field, never a key: the messages go to the log.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RIGHTS = ("inference", "cache_admin", "metrics")
DEFAULT_ALLOW = frozenset({"inference", "cache_admin"})
ANONYMOUS = "anonymous"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_FIELDS = {"name", "keys", "max_concurrent_requests", "max_queued_requests", "tokens_per_minute", "priority",
           "cache_salt", "allow"}
# Prefix of every tenant's salt. A request's own cache_salt may not start with it (400), so a
# request of the anonymous tenant can never produce a chain that a named tenant's requests make.
SALT_PREFIX = "kvserve-tenant:"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: a 1,000-tenant file in milliseconds


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the tenant and field (never a key)."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Tenant:
    """One tenant. ``salt`` None: requests are not salted by tenant (the anonymous tenant)."""

    name: str
    max_concurrent_requests: int | None = None
    max_queued_requests: int = 0
    tokens_per_minute: int | None = None
    priority: int = 0
    salt: str | None = field(default=None, repr=False)
    allow: frozenset[str] = frozenset(RIGHTS)

    def cache_salt(self, request_salt: str | None) -> str | None:
        """The salt of this tenant's request chain: the tenant's first, then the request's own
        (which splits further within the tenant). Length-prefixed, so no two (tenant, request)
        pairs give the same string."""
        if self.salt is None:
            return request_salt
        base = f"{SALT_PREFIX}{len(self.salt)}:{self.salt}"
        return base if request_salt is None else f"{base}:{request_salt}"

    def effective_priority(self, requested: int) -> int:
        """The request's priority, never better (lower) than this tenant's floor."""
        return max(requested, self.priority)


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


@dataclass(frozen=True)
class KeyFile:
    """A parsed key file: the tenants and the sha256 digest of each key -> its tenant."""

    tenants: tuple[Tenant, ...]
    by_digest: dict[bytes, tuple[Tenant, bytes]]  # digest -> (tenant, the digest as stored)


def _int(entry: dict[str, Any], name: str, key: str, low: int, default: Any) -> Any:
    value = entry.get(key, default)
    if value is default:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise KeyFileError(f"tenant {name!r}: {key} must be an integer >= {low}")
    return value


def _tenant(entry: Any, index: int) -> tuple[Tenant, list[bytes]]:
    if not isinstance(entry, dict):
        raise KeyFileError(f"tenants[{index}] must be a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or name == ANONYMOUS:
        raise KeyFileError(f"tenants[{index}].name must match [A-Za-z0-9_.-]{{1,64}} and not be "
                           f"{ANONYMOUS!r}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise KeyFileError(f"tenant {name!r}: unknown field(s) {', '.join(map(str, unknown))} "
                           f"(known: {', '.join(sorted(_FIELDS))})")
    keys = entry.get("keys")
    if not isinstance(keys, list) or not keys:
        raise KeyFileError(f"tenant {name!r}: keys must be a non-empty list")
    digests = []
    for k, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise KeyFileError(f"tenant {name!r}: keys[{k}] must be a non-empty string")
        match = _DIGEST.match(key)
        if key.startswith("sha256:") and match is None:
            raise KeyFileError(f"tenant {name!r}: keys[{k}] starts with 'sha256:' but is not 64 hex digits")
        digests.append(bytes.fromhex(match.group(1)) if match else key_digest(key))
    concurrent = _int(entry, name, "max_concurrent_requests", 1, None)
    queued = _int(entry, name, "max_queued_requests", 0, 0)
    if queued and concurrent is None:
        raise KeyFileError(f"tenant {name!r}: max_queued_requests needs max_concurrent_requests (it bounds the "
                           "requests waiting for one of those slots)")
    priority = entry.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise KeyFileError(f"tenant {name!r}: priority must be an integer")
    salt = entry.get("cache_salt")
    if salt is None:
        salt = hashlib.sha256(f"kvserve tenant {name}".encode()).hexdigest()
    elif not isinstance(salt, str) or not salt:
        raise KeyFileError(f"tenant {name!r}: cache_salt must be a non-empty string")
    allow = entry.get("allow", sorted(DEFAULT_ALLOW))
    if not isinstance(allow, list) or any(a not in RIGHTS for a in allow):
        raise KeyFileError(f"tenant {name!r}: allow must be a list of {', '.join(RIGHTS)}")
    tenant = Tenant(name, concurrent, queued, _int(entry, name, "tokens_per_minute", 1, None), priority, salt,
                    frozenset(allow))
    return tenant, digests


def parse_key_file(text: str) -> KeyFile:
    try:
        # bandit B506: _LOADER is a SafeLoader (libyaml's when present)
        doc = yaml.load(text, Loader=_LOADER)  # noqa: S506  # nosec B506
    except yaml.YAMLError as exc:
        # Only where and what: the file's own text (a key, maybe) stays out of the message.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise KeyFileError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or type(exc).__name__}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list) or set(doc) != {"tenants"}:
        raise KeyFileError("the key file must be a mapping with one key, 'tenants', a list")
    tenants: list[Tenant] = []
    by_digest: dict[bytes, tuple[Tenant, bytes]] = {}
    for index, entry in enumerate(doc["tenants"]):
        tenant, digests = _tenant(entry, index)
        if any(t.name == tenant.name for t in tenants):
            raise KeyFileError(f"tenant {tenant.name!r} is listed twice")
        for k, digest in enumerate(digests):
            other = by_digest.get(digest)
            if other is not None:
                raise KeyFileError(f"tenant {tenant.name!r}: keys[{k}] is also a key of tenant {other[0].name!r}")
            by_digest[digest] = (tenant, digest)
        tenants.append(tenant)
    return KeyFile(tuple(tenants), by_digest)


def load_key_file(path: str | Path) -> KeyFile:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyFileError(f"cannot read the key file: {exc.strerror or type(exc).__name__}") from None
    return parse_key_file(text)
