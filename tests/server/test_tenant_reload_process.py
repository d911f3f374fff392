"""A real ``kvserve serve --api-key-file`` process (a tiny GGUF) re-reads its key file on SIGHUP:
an added key works, a removed one gets 401, and a malformed file keeps the old tenants."""
from __future__ import annotations

import signal
import time

import httpx

from tests.server.conftest import SERVER_START_TIMEOUT_S, start_server_process, stop_server_process, wait_healthy


def _status(base_url: str, key: str) -> int:
    return httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def _until(predicate, what: str, log) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: {log()[-2000:]}"
        time.sleep(0.05)


def test_sighup_reloads_the_key_file_of_a_running_server(tmp_path):
    from bench.make_gguf import GGUFShape, write_gguf

    model = write_gguf(tmp_path / "tiny.gguf", GGUFShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128,
                                                         context=512), lambda *_: None)
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  - name: a\n    keys: [sk-first]\n")
    # thread mode: one process start, and the signal handler lives in the frontend either way
    server = start_server_process(tmp_path, "--model", str(model), "--max-model-len", "512", "--engine-mode", "thread",
                                  "--api-key-file", str(keys))
    try:
        wait_healthy(server.base_url, SERVER_START_TIMEOUT_S, server.proc)
        assert _status(server.base_url, "sk-first") == 200 and _status(server.base_url, "sk-second") == 401
        keys.write_text("tenants:\n  - name: a\n    keys: [sk-second]\n")
        server.proc.send_signal(signal.SIGHUP)
        _until(lambda: _status(server.base_url, "sk-second") == 200, "the added key", server.log)
        assert _status(server.base_url, "sk-first") == 401
        keys.write_text("tenants:\n  - name: a\n    keys: [sk-third\n")  # malformed
        server.proc.send_signal(signal.SIGHUP)
        _until(lambda: "key file reload failed" in server.log(), "the reload error in the log", server.log)
        assert _status(server.base_url, "sk-second") == 200 and server.proc.poll() is None
        assert "sk-third" not in server.log() and "sk-second" not in server.log()
    finally:
        stop_server_process(server)
