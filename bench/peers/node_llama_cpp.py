"""llama.cpp as an in-process peer, through the npm package ``node-llama-cpp`` (it ships a
prebuilt CPU llama.cpp). llama.cpp's own HTTP server is the other llama.cpp peer
(``bench.peers.llama_server``).

* ``ensure_node_llama_cpp()`` installs the package with ``npm install`` into the bench cache
  (``bench.peers.base.cache_dir``, never into the repo) once; every later run works offline.
* ``run_llamacpp()`` runs a request list through ``node_llama_cpp_runner.mjs`` (beside this
  file): greedy, raw token ids in, a fixed number of output tokens, ``parallel`` sequences of
  one context batched together by node-llama-cpp; per-request first-token and last-token
  times come back. ``run_single`` / ``run_batch`` summarize one such run as the ``peers``
  scenario's rows (decode tok/s of one stream; output tok/s of a batch).
* The all-F32 file it can run instead of the shipped Q4_1 one is ``bench.peers.gguf_files.f32_gguf``.

Any failure raises ``PeerUnavailable`` with the reason, so the caller can report the peer
as skipped (never silently dropped).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from bench.peers.base import PeerUnavailable, cache_dir

RUNNER = Path(__file__).resolve().parent / "node_llama_cpp_runner.mjs"
PACKAGE = "node-llama-cpp"
MIN_NODE_MAJOR = 20


def node_dir() -> Path:
    return cache_dir() / "node"


def ensure_node_llama_cpp(install: bool = True, timeout_s: float = 600.0) -> Path:
    """The folder whose ``node_modules`` holds node-llama-cpp; installs it there if missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None:
        raise PeerUnavailable("node is not installed (node-llama-cpp needs Node.js >= 20)")
    try:
        version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        major = int(version.lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"cannot run node: {exc}") from exc
    if major < MIN_NODE_MAJOR:
        raise PeerUnavailable(f"node {version} is too old; node-llama-cpp needs >= {MIN_NODE_MAJOR}")
    folder = node_dir()
    if (folder / "node_modules" / PACKAGE / "package.json").exists():
        return folder
    if not install:
        raise PeerUnavailable(f"{PACKAGE} is not installed in {folder} (run without --no-install)")
    if npm is None:
        raise PeerUnavailable("npm is not installed, so node-llama-cpp cannot be installed")
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "package.json").exists():
        (folder / "package.json").write_text(json.dumps({"name": "kvserve-bench-node", "private": True,
                                                          "type": "module"}) + "\n")
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", PACKAGE], cwd=folder, capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0 or not (folder / "node_modules" / PACKAGE / "package.json").exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PeerUnavailable(f"npm install {PACKAGE} failed (rc {proc.returncode}): {' | '.join(tail)}")
    return folder


def installed_version(folder: Path) -> str | None:
    try:
        return json.loads((folder / "node_modules" / PACKAGE / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def run_llamacpp(model_path: str | os.PathLike, requests: Sequence[Any], parallel: int, threads: int,
                 context_size: int | None = None, timeout_s: float = 1800.0, install: bool = True) -> dict[str, Any]:
    """Run ``requests`` (objects with ``prompt_token_ids`` and ``output_len``) through llama.cpp.

    Returns ``elapsed_s`` (first submission to last token), per-request ``ttft_s``, ``decode_s``,
    ``tokens`` (the generated ids) and the load time. Raises ``PeerUnavailable``.
    """
    folder = ensure_node_llama_cpp(install)
    runner = folder / RUNNER.name
    if not runner.exists() or runner.read_bytes() != RUNNER.read_bytes():
        shutil.copyfile(RUNNER, runner)  # run from the cache dir so `import "node-llama-cpp"` resolves there
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    spec = {"model": str(model_path), "threads": threads, "parallel": max(1, min(parallel, len(requests))),
            "contextSize": context_size or longest + 16,
            "requests": [{"tokens": list(map(int, r.prompt_token_ids)), "maxTokens": int(r.output_len)}
                         for r in requests]}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, NODE_LLAMA_CPP_SKIP_DOWNLOAD="true")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["node", str(runner), str(spec_path), str(out_path)], cwd=folder,
                                  capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as exc:
            raise PeerUnavailable(f"llama.cpp run exceeded {timeout_s:.0f} s") from exc
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
            raise PeerUnavailable(f"node-llama-cpp failed (rc {proc.returncode}): {' | '.join(tail)}")
        result = json.loads(out_path.read_text())
    result["process_wall_s"] = wall
    result["package_version"] = installed_version(folder)
    return result


def run_single(gguf: str | os.PathLike, requests: Sequence[Any], threads: int, install: bool) -> dict[str, Any]:
    """``requests`` one at a time: decode tok/s of the stream (prefill left out), median TTFT."""
    out = run_llamacpp(gguf, requests, parallel=1, threads=threads, install=install)
    reqs = out["requests"]
    return {"decode_tps": round(sum(len(r["tokens"]) - 1 for r in reqs) / sum(r["decode_s"] for r in reqs), 3),
            "ttft_ms": round(1000 * sorted(r["ttft_s"] for r in reqs)[len(reqs) // 2], 2),
            "output_tokens": sum(len(r["tokens"]) for r in reqs), "load_s": round(out["load_s"], 2),
            "version": out.get("package_version"), "llama_cpp_release": out.get("llama_cpp_release")}


def run_batch(gguf: str | os.PathLike, requests: Sequence[Any], parallel: int, threads: int,
              install: bool) -> dict[str, Any]:
    """``requests`` as ``parallel`` sequences of one context: output tok/s over the run."""
    out = run_llamacpp(gguf, requests, parallel=parallel, threads=threads, install=install)
    tokens = sum(len(r["tokens"]) for r in out["requests"])
    return {"tps": round(tokens / out["elapsed_s"], 3), "elapsed_s": round(out["elapsed_s"], 3),
            "output_tokens": tokens, "parallel": out["parallel"]}
