"""The real agent CLIs, unchanged, against a kvserve subprocess: OpenAI's Codex CLI over
``/v1/responses`` and Anthropic's Claude Code over ``/v1/messages``.

Both come from npm at pinned versions, installed once into a cache folder outside the
repository (``~/.cache/kvserve-test-npm/<pins>``); without ``node``/``npm``, or when the
install fails (no registry reachable), the tests skip and say why.

Their prompts (~10k tokens for Codex, ~20k for Claude Code) exceed the default model's
context, so the server serves a tiny random-weight GGUF with a 64k context: the tests check the
protocol, not the answer. A random model never emits EOS and neither CLI bounds the output
(Codex sends no ``max_output_tokens``; Claude Code's 32000 ``max_tokens`` is clamped to the
context's room), so generation would run toward the context end. The GGUF is therefore crafted
to end every turn at once: one residual dimension is constant across the token embeddings and
only the EOS row of the LM head reads it, so EOS wins the first sample at any temperature.
No server default changes for real models.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import SERVER_START_TIMEOUT_S, start_server_process, stop_server_process, wait_healthy

pytestmark = pytest.mark.slow

CODEX = "@openai/codex@0.171.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
NPM_DIR = Path.home() / ".cache" / "kvserve-test-npm" / "codex-0.171.0-claude-code-2.1.332"
MODEL = "tiny-long"
CONTEXT = 65536
API_KEY = "sk-kvserve-agent-cli"
CLI_TIMEOUT_S = 180


def npm_bin() -> Path:
    """The folder holding ``codex`` and ``claude``, installing them on first use (skip when impossible)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not found: the agent CLIs come from npm")
    bin_dir = NPM_DIR / "node_modules" / ".bin"
    if not ((bin_dir / "codex").exists() and (bin_dir / "claude").exists()):
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NPM_DIR),
                                   CODEX, CLAUDE_CODE], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {CODEX} {CLAUDE_CODE} timed out (no registry?)")
        if done.returncode != 0:
            pytest.skip(f"npm install {CODEX} {CLAUDE_CODE} failed (no registry?): {done.stderr[-500:]}")
    return bin_dir


def write_eos_gguf(path: Path) -> Path:
    """The tiny long-context GGUF whose every turn ends with EOS on its first token (see the module doc)."""
    import gguf

    from bench.make_gguf import GGUFShape, write_gguf
    from engine.loader.gguf.blocks import BlockFormat

    write_gguf(path, GGUFShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, context=CONTEXT),
               lambda name, layer, layers: None if name in ("token_embd", "output") else BlockFormat.Q8_0)
    reader = gguf.GGUFReader(path, "r+")
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())  # what the served model stops on
    tensors = {t.name: t.data for t in reader.tensors}
    tensors["token_embd.weight"][:, 0] = 20.0  # a constant dimension that dominates the final norm
    lm_head = tensors["output.weight"]
    lm_head[:, 0] = 0.0
    lm_head[eos, :] = 0.0
    lm_head[eos, 0] = 100.0  # only EOS reads it: a logit of several hundred, the others near 0
    reader.data.flush()
    del reader, tensors, lm_head
    return path


@pytest.fixture(scope="module")
def clis() -> Path:
    return npm_bin()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-clis")
    gguf_path = write_eos_gguf(tmp / f"{MODEL}.gguf")
    server = start_server_process(tmp, "--model", str(gguf_path), "--max-model-len", str(CONTEXT),
                                  "--kv-cache-memory", "0.25", "--api-key", API_KEY)
    try:
        wait_healthy(server.base_url, SERVER_START_TIMEOUT_S, server.proc)
        yield server
    finally:
        stop_server_process(server)


def metrics(server) -> dict[str, float]:
    """The counters the tests read, summed over their labels."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name in ("request_success_total", "request_errors_total", "prefix_cache_hits_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^kvserve_{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return out


# A proxy that refuses every connection: what a CLI tries beyond 127.0.0.1 (updates, telemetry,
# Codex's plugin sync) fails at once instead of reaching the internet or hanging on it.
NO_INTERNET = {name: "http://127.0.0.1:9" for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                                                         "http_proxy", "https_proxy", "all_proxy")}
NO_INTERNET.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: a writable HOME of its own, no internet, no updater or telemetry."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, **NO_INTERNET, "HOME": str(home), "NO_COLOR": "1", **extra}


def run_cli(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd[0]} ran past {CLI_TIMEOUT_S} s: {exc.stdout!r} {exc.stderr!r}")


def assert_counted_successful(server, before: dict[str, float], cli: str) -> None:
    after = metrics(server)
    assert after["request_success_total"] > before["request_success_total"], \
        f"{cli} made no request the server finished: {server.log()[-3000:]}"
    assert after["request_errors_total"] == before["request_errors_total"], server.log()[-3000:]


def test_codex_exec(clis, tiny_server, tmp_path):
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "kvserve"\n\n[model_providers.kvserve]\nname = "kvserve"\n'
        f'base_url = "{tiny_server.base_url}/v1"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n')
    env = cli_env(tmp_path, CODEX_HOME=str(codex_home), OPENAI_API_KEY=API_KEY)
    before = metrics(tiny_server)
    done = run_cli([str(clis / "codex"), "exec", "--skip-git-repo-check", "--json", "Say hello"], env, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds, kinds
    assert not {"error", "turn.failed"} & set(kinds), events
    assert_counted_successful(tiny_server, before, "codex")
    assert "tools not offered to the model" in tiny_server.log()  # Codex's hosted web_search, named


def test_claude_code_print_and_a_second_turn_from_the_prefix_cache(clis, tiny_server, tmp_path):
    env = cli_env(tmp_path, ANTHROPIC_BASE_URL=tiny_server.base_url, ANTHROPIC_API_KEY=API_KEY,
                  ANTHROPIC_MODEL=MODEL, DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
                  DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    claude = [str(clis / "claude"), "--model", MODEL, "--output-format", "json"]

    def turn(*args: str) -> dict:
        before = metrics(tiny_server)
        debug = tmp_path / f"claude-debug-{len(args)}.txt"
        done = run_cli([*claude, "--debug-file", str(debug), *args], env, tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # Claude Code recovers from a refused request by sending it again without the refused
        # feature, and still exits 0: its debug log is where a 400 shows
        refused = [line for line in debug.read_text(errors="replace").splitlines() if "API error" in line]
        assert not refused, refused
        result = json.loads(done.stdout)
        assert result["is_error"] is False and result["subtype"] == "success", result
        assert result.get("api_error_status") is None, result
        assert_counted_successful(tiny_server, before, "claude")
        return result

    turn("-p", "Say hello")
    hits = metrics(tiny_server)["prefix_cache_hits_total"]
    second = turn("--continue", "-p", "Say hello again")
    # the second turn's system prompt and tools come from the prefix cache, and are reported so
    assert metrics(tiny_server)["prefix_cache_hits_total"] > hits
    assert second["usage"]["cache_read_input_tokens"] > 10_000, second["usage"]
