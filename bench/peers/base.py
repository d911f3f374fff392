"""What the peer adapters share: ``PeerUnavailable``, the bench cache folder, and ``Server``,
the handle of an HTTP server the suite's client drives (kvserve or a peer).

``launch`` starts a server command in a child process and returns its ``Server`` once
``/health`` answers 200; the suite starts ``kvserve serve`` with it (``bench.server``) and
``bench.peers.llama_server`` starts llama-server with it, so both sides are started, watched
and stopped the same way.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or run here; the message is the reason."""


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_BENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvserve-bench"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str
    kind: str  # "subprocess" | "inprocess" | "url"
    api_key: str | None = None
    log_path: str | None = None
    _close: Any = None
    pid: int | None = None  # the server process when it is our child (its CPU is not "foreign" load)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_name(url: str, api_key: str | None) -> str:
    r = httpx.get(f"{url}/v1/models", headers=headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def wait_healthy(url: str, timeout_s: float, alive: Any = lambda: True) -> None:
    """Poll ``url``/health until it answers 200; fail early once ``alive()`` is False."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it became healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def launch(cmd: Sequence[str], url: str, kind: str, log_path: str | os.PathLike | None = None,
           timeout_s: float = 300.0, model: str | None = None, **popen: Any) -> Server:
    """Start ``cmd``, a server that will answer at ``url``; a ``Server`` once ``/health`` is 200.

    Output goes to ``log_path`` (appended) or nowhere. ``close()`` sends SIGTERM and kills after
    30 s; a child that exits or stays unhealthy for ``timeout_s`` is closed and the error raised.
    ``model`` defaults to the first id that ``/v1/models`` lists.
    """
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, **popen)

    def close() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if log is not subprocess.DEVNULL:
            log.close()

    try:
        wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
        model = model or model_name(url, None)
    except BaseException:
        close()
        raise
    return Server(url, model, kind, None, str(log_path) if log_path else None, close, proc.pid)
