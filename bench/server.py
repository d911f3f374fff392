"""kvserve as the suite's server: three ways to get one (a ``Server``, closed with ``.close()``).

* ``start_subprocess``: ``python -m kvserve.cli serve --port P ...`` (what ``kvserve serve``
  runs), its log in a file, ready when ``/health`` answers 200; closed with SIGTERM;
* ``start_inprocess``: an app someone composed (``kvserve.compose.build_service``; bench never
  imports server/) under uvicorn in a thread (tests use it with a tiny engine);
* ``connect``: a server someone else runs (``--url``).

``Server``, ``launch``, ``wait_healthy`` and ``free_port`` are the peers' (``bench.peers.base``):
kvserve and llama-server are started and stopped the same way, and the same client
(``bench.client``) drives both.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from bench.peers.base import Server, free_port, launch, model_name, wait_healthy

__all__ = ["REPO_ROOT", "Server", "connect", "free_port", "launch", "start_inprocess", "start_subprocess",
           "wait_healthy"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def connect(url: str, api_key: str | None = None) -> Server:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    wait_healthy(url, 30)
    return Server(url, model_name(url, api_key), "url", api_key)


def start_subprocess(serve_args: Sequence[str] = (), port: int | None = None, log_path: str | os.PathLike | None = None,
                     timeout_s: float = 300.0) -> Server:
    """``kvserve serve --host 127.0.0.1 --port P *serve_args`` in a child process."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--shutdown-grace", "2", *serve_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("KVSERVE_API_KEY", None)
    return launch(cmd, f"http://127.0.0.1:{port}", "subprocess", log_path, timeout_s, cwd=REPO_ROOT, env=env)


def start_inprocess(app: Any, model_name: str, port: int | None = None) -> Server:
    """``app`` (an ASGI app, e.g. ``kvserve.compose.build_service(...).app``) under uvicorn in a daemon
    thread; the app's lifespan stops its engine when the server is closed."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def close() -> None:
        server.should_exit = True
        thread.join(30)

    try:
        wait_healthy(url, 60, alive=thread.is_alive)
    except BaseException:
        close()
        raise
    return Server(url, model_name, "inprocess", None, None, close)

