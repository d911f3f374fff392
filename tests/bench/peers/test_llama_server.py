"""The llama-server peer adapter: its command lines, slot arithmetic, the sid tree checks and its
answer parsing, all pure logic on a clean machine (the tree is never built here: that is
``sudo scripts/llama-server-peer.sh build``, ~3 min, network).
"""
from __future__ import annotations

import os

import pytest

from bench.peers.base import PeerUnavailable
from bench.peers.llama_server import (MODEL_ALIAS, SCRIPT, LlamaServerConfig, ctx_size_for, kquant_path,
                                      llama_server_token_id, quantize_command, rootfs_dir, rootfs_ready,
                                      serve_command)


# ---- command building ---------------------------------------------------------------------------
def test_serve_command_passes_threads_slots_and_context(tmp_path):
    cfg = LlamaServerConfig(tmp_path / "m.gguf", port=8123, threads=2, parallel=8, ctx_size=8192,
                            extra=("--cont-batching",))
    cmd = serve_command(cfg)
    assert cmd[:3] == ["bash", str(SCRIPT), "serve"]
    opts = dict(zip(cmd[3:13:2], cmd[4:13:2]))
    assert opts == {"--model": str(tmp_path / "m.gguf"), "--port": "8123", "--threads": "2", "--parallel": "8",
                    "--ctx-size": "8192"}
    # after "--": passed through to llama-server itself
    assert cmd[cmd.index("--") + 1:] == ["--alias", MODEL_ALIAS, "--cont-batching"]


def test_config_rejects_nonsense_and_ctx_size_covers_every_slot(tmp_path):
    with pytest.raises(ValueError):
        LlamaServerConfig(tmp_path / "m.gguf", 1, threads=0)
    with pytest.raises(ValueError):
        LlamaServerConfig(tmp_path / "m.gguf", 1, threads=1, parallel=4, ctx_size=2)
    # 16 slots of (50 prompt + 128 output + 16) tokens: each slot gets ctx_size / parallel >= 194
    total = ctx_size_for(16, 50 + 128 + 16)
    assert total % 16 == 0 and total // 16 >= 194 and total // 16 == 256
    assert ctx_size_for(1, 1000 + 128 + 16) == 1280


def test_quantize_command_and_cache_key(tmp_path):
    src = tmp_path / "SmolLM2-135M-Instruct-F32-abc.gguf"
    src.write_bytes(b"weights")
    dst = kquant_path(src, "Q4_K_M", tmp_path)
    assert dst.parent == tmp_path and dst.name.startswith("SmolLM2-135M-Instruct-abc-Q4_K_M-")
    src.write_bytes(b"other weights")  # another source: another file, never a stale one
    assert kquant_path(src, "Q4_K_M", tmp_path) != dst
    cmd = quantize_command(src, dst, "Q8_0", threads=3)
    assert cmd == ["bash", str(SCRIPT), "quantize", str(src), str(dst), "Q8_0", "--threads", "3"]


def test_script_is_valid_bash_and_explains_a_missing_tree(tmp_path):
    import subprocess

    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    env = dict(os.environ, LLAMA_PEER_ROOTFS=str(tmp_path / "none"))
    out = subprocess.run(["bash", str(SCRIPT), "version"], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "build" in out.stderr and str(tmp_path / "none") in out.stderr


def test_missing_tree_is_peer_unavailable_with_the_build_command(tmp_path, monkeypatch):
    from bench.peers import llama_server

    monkeypatch.setenv("LLAMA_PEER_ROOTFS", str(tmp_path / "none"))
    assert rootfs_dir() == tmp_path / "none" and not rootfs_ready()
    with pytest.raises(PeerUnavailable, match="llama-server-peer.sh build|needs root"):
        llama_server.check_available()


def test_llama_server_token_id_reads_both_answer_shapes():
    assert llama_server_token_id({"tokens": [260], "content": " the"}) == 260
    assert llama_server_token_id({"completion_probabilities": [{"id": 17, "token": "x"}]}) == 17
    with pytest.raises(ValueError):
        llama_server_token_id({"content": "x"})
