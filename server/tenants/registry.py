"""Who is asking: API key -> ``Tenant``, the tenant of the request being served, and reload.

Three modes, fixed at start: open (no key: every request is the anonymous tenant), one key
(``--api-key``: its holder is the anonymous tenant, unsalted, as before tenants existed), and
a key file (``--api-key-file``: each key names its tenant; the two flags exclude each other).

Keys are never kept or compared as text: a presented key is hashed (sha256) and looked up in a
dict keyed by the digests, then compared with ``hmac.compare_digest`` against the digest found;
the dict lookup compares digests, which nobody can steer byte by byte without the key, so the
time taken says nothing about the keys and does not grow with the number of tenants.

Reload (``reload``, on SIGHUP): the file is parsed whole and replaces the table in one
reference assignment, so every request sees the old table or the new one. A request keeps the
``Tenant`` it authenticated as until it ends. A file that does not parse is logged (what and
where, never its text) and the old table stays.
"""
from __future__ import annotations

import hmac
import logging
import signal
import threading
from contextvars import ContextVar
from pathlib import Path
from typing import Callable

from server.tenants.config import ANONYMOUS_TENANT, KeyFile, KeyFileError, Tenant, key_digest, load_key_file

logger = logging.getLogger("kvserve.tenants")

_CURRENT: ContextVar[Tenant] = ContextVar("kvserve_tenant", default=ANONYMOUS_TENANT)


def current_tenant() -> Tenant:
    """The tenant of the request this task serves (set by the auth dependency)."""
    return _CURRENT.get()


def set_current_tenant(tenant: Tenant) -> None:
    _CURRENT.set(tenant)


class TenantRegistry:
    def __init__(self, api_key: str | None = None, key_file: str | Path | None = None) -> None:
        if api_key is not None and key_file is not None:
            raise ValueError("--api-key and --api-key-file exclude each other (a key file can hold that key)")
        self.path = Path(key_file) if key_file is not None else None
        self._api_key_digest = key_digest(api_key) if api_key is not None else None
        self._file: KeyFile | None = load_key_file(self.path) if self.path is not None else None

    @property
    def uses_key_file(self) -> bool:
        return self._file is not None

    @property
    def open(self) -> bool:
        """No key is needed."""
        return self._file is None and self._api_key_digest is None

    def names(self) -> list[str]:
        return [t.name for t in self._file.tenants] if self._file is not None else []

    def tenant(self, name: str) -> Tenant | None:
        file = self._file
        return next((t for t in file.tenants if t.name == name), None) if file is not None else None

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant whose key ``key`` is, or None (a 401)."""
        file = self._file  # one snapshot: a concurrent reload swaps the reference, not its contents
        if file is None:
            if self._api_key_digest is None:
                return ANONYMOUS_TENANT
            if key is None:
                return None
            return ANONYMOUS_TENANT if hmac.compare_digest(key_digest(key), self._api_key_digest) else None
        if key is None:
            return None
        digest = key_digest(key)
        found = file.by_digest.get(digest)
        if found is None:
            return None
        tenant, stored = found
        return tenant if hmac.compare_digest(digest, stored) else None

    def reload(self) -> bool:
        """Re-read the key file; False (old tenants kept, reason logged) if it cannot be used."""
        if self.path is None:
            return False
        try:
            new = load_key_file(self.path)
        except KeyFileError as exc:
            logger.error("key file reload failed, keeping the %d tenants loaded before: %s",
                         len(self._file.tenants) if self._file else 0, exc)
            return False
        self._file = new
        logger.info("key file reloaded: %d tenants", len(new.tenants))
        return True

    def install_reload_signal(self, reload: Callable[[], bool] | None = None) -> bool:
        """Call ``reload`` (default: ``self.reload``) on SIGHUP (main thread only, with a key
        file); True if installed."""
        if self.path is None or threading.current_thread() is not threading.main_thread() \
                or not hasattr(signal, "SIGHUP"):
            return False
        handler = reload or self.reload
        # Parsed on a thread of its own: the handler runs on the event loop's thread, which must
        # not stall on a large file; the swap at the end is one reference assignment.
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=handler, name="kvserve-key-reload",
                                                                 daemon=True).start())
        return True
