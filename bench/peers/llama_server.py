"""llama.cpp's own HTTP server (``llama-server``) as a benchmark peer.

The binary comes from Debian sid's ``llama.cpp-tools`` package, installed into a debootstrapped
sid tree that ``scripts/llama-server-peer.sh build`` makes once (root; ~3 minutes, ~180 MB)
under ``~/.cache/kvserve-bench/llama-sid-rootfs`` (``KVSERVE_BENCH_CACHE`` moves the cache,
``LLAMA_PEER_ROOTFS`` names the tree itself). The script runs the server chrooted into that
tree in a private mount namespace, on the host's loopback; this module only builds its
command line, starts it, waits for ``/health`` and stops it. Nothing here builds the tree:
a missing tree, a non-root user or a server that does not come up raise ``PeerUnavailable``
with the reason and the command that fixes it.

* ``start_llama_server(LlamaServerConfig(...))`` is the one way to start it: a
  ``bench.peers.base.Server``, so the client of kvserve's HTTP rows (``bench.client.run_load``:
  same payloads, same SSE parsing, usage from the final chunk) drives both servers. The one way
  to run it against kvserve is the suite's ``llama-server`` scenario (``bench.vs_llama_server``,
  ``python -m bench llama-server``).
* ``resolve_gguf()`` / ``kquant_ggufs()``: the file it runs; K-quant files of the default model are
  made with the tree's ``llama-quantize`` (from the all-F32 conversion of the shipped GGUF,
  ``bench.peers.gguf_files.f32_gguf``) and cached next to it.
* ``llama_server_next_token()``: one greedy token per prompt through its native ``/completion``
  (its OpenAI routes have no prompt logprobs), for the teacher-forced agreement (``bench.agreement``).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from bench.peers.base import PeerUnavailable, Server, cache_dir, file_sha256, launch
from bench.peers.gguf_files import f32_gguf

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llama-server-peer.sh"
BUILD_HINT = f"build it once (root, ~3 min): sudo {SCRIPT.relative_to(SCRIPT.parent.parent)} build"
SERVER_BIN = "usr/bin/llama-server"
READY_MARK = ".kvserve-peer-ready"  # written by the script's build step: the package version
MODEL_ALIAS = "llama-server-model"
KQUANT_TYPES = ("Q4_K_M", "Q8_0")
HALF_TYPES = ("F16", "BF16")  # unquantized files, made the same way on request


def rootfs_dir() -> Path:
    """The sid tree the script uses (same defaults as the script)."""
    root = os.environ.get("LLAMA_PEER_ROOTFS")
    return Path(root).expanduser() if root else cache_dir() / "llama-sid-rootfs"


def rootfs_ready(root: Path | None = None) -> bool:
    root = root or rootfs_dir()
    return (root / SERVER_BIN).exists() and (root / READY_MARK).exists()


def package_version(root: Path | None = None) -> str | None:
    """The ``llama.cpp-tools`` version installed in the tree (e.g. ``1:0.7.0+dfsg-2``)."""
    try:
        return (Path(root or rootfs_dir()) / READY_MARK).read_text().strip() or None
    except OSError:
        return None


def check_available(root: Path | None = None) -> None:
    """Raise ``PeerUnavailable`` unless this process can run the peer (root, unshare, the tree)."""
    root = root or rootfs_dir()
    if not SCRIPT.exists():
        raise PeerUnavailable(f"{SCRIPT} is missing")
    if os.geteuid() != 0:
        raise PeerUnavailable("llama-server runs chrooted in a private mount namespace, which needs root")
    if not rootfs_ready(root):
        raise PeerUnavailable(f"no llama-server tree at {root}: {BUILD_HINT}")


@dataclass(frozen=True)
class LlamaServerConfig:
    """One llama-server process: ``threads`` for -t and -tb, ``parallel`` slots, each with
    ``ctx_size / parallel`` tokens of context (llama-server's own split)."""

    model: Path
    port: int
    threads: int
    parallel: int = 1
    ctx_size: int = 4096
    extra: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.threads < 1 or self.parallel < 1 or self.ctx_size < self.parallel:
            raise ValueError(f"bad llama-server config: threads {self.threads}, parallel {self.parallel}, "
                             f"ctx_size {self.ctx_size}")


def ctx_size_for(parallel: int, tokens_per_slot: int, round_to: int = 256) -> int:
    """Total context so that each of ``parallel`` slots holds ``tokens_per_slot`` tokens."""
    per_slot = -(-tokens_per_slot // round_to) * round_to
    return parallel * per_slot


def serve_command(cfg: LlamaServerConfig, script: Path = SCRIPT) -> list[str]:
    """The command line that runs ``cfg`` in the foreground (the script execs llama-server,
    so the child's pid is llama-server's)."""
    return ["bash", str(script), "serve", "--model", str(cfg.model), "--port", str(cfg.port),
            "--threads", str(cfg.threads), "--parallel", str(cfg.parallel), "--ctx-size", str(cfg.ctx_size),
            "--", "--alias", MODEL_ALIAS, *cfg.extra]


def start_llama_server(cfg: LlamaServerConfig, log_path: str | os.PathLike | None = None,
                       timeout_s: float = 180.0) -> Server:
    """Start llama-server for ``cfg``; its ``Server`` once ``/health`` answers 200."""
    check_available()
    if not Path(cfg.model).is_file():
        raise PeerUnavailable(f"no GGUF file at {cfg.model}")
    url = f"http://127.0.0.1:{cfg.port}"
    try:
        return launch(serve_command(cfg), url, "llama-server", log_path, timeout_s, model=MODEL_ALIAS,
                      start_new_session=True)
    except (RuntimeError, TimeoutError) as exc:
        tail = _tail(log_path)
        raise PeerUnavailable(f"llama-server did not come up ({exc}){': ' + tail if tail else ''}") from exc


def _tail(path: str | os.PathLike | None, lines: int = 3) -> str:
    if not path:
        return ""
    try:
        return " | ".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ---- K-quant files ---------------------------------------------------------------------------
def quantize_command(src: Path, dst: Path, qtype: str, threads: int = 2, script: Path = SCRIPT) -> list[str]:
    return ["bash", str(script), "quantize", str(src), str(dst), qtype, "--threads", str(threads)]


def kquant_path(source: Path, qtype: str, out_dir: Path | None = None) -> Path:
    """Where the ``qtype`` file made from ``source`` is cached (keyed by the source's hash)."""
    stem = source.stem.replace(".Q4_1", "").replace("-F32", "")
    return (out_dir or cache_dir()) / f"{stem}-{qtype}-{file_sha256(source)[:12]}.gguf"


def kquant_ggufs(types: Sequence[str] = KQUANT_TYPES, source: str | os.PathLike | None = None,
                 threads: int = 2, timeout_s: float = 900.0) -> dict[str, Path]:
    """``{type: path}`` of the default model quantized by llama-quantize to each of ``types``,
    made once from the all-F32 conversion of the shipped GGUF (``source`` overrides it) and
    cached in the bench cache. Raises ``PeerUnavailable`` when the tree is missing."""
    src = Path(source) if source else f32_gguf()
    out: dict[str, Path] = {}
    for qtype in types:
        dst = kquant_path(src, qtype)
        if not dst.exists():
            check_available()
            tmp = dst.with_name(dst.stem + ".tmp.gguf")
            proc = subprocess.run(quantize_command(src, tmp, qtype, threads), capture_output=True, text=True,
                                  timeout=timeout_s)
            if proc.returncode != 0 or not tmp.exists():
                tmp.unlink(missing_ok=True)
                tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
                raise PeerUnavailable(f"llama-quantize {qtype} failed (rc {proc.returncode}): {tail}")
            tmp.replace(dst)
        out[qtype] = dst
    return out


def resolve_gguf(spec: str | None) -> Path:
    """A ``--gguf`` value: None (the shipped Q4_1 file), ``f32``, a type llama-quantize makes
    (``Q8_0`` / ``Q4_K_M`` / ``F16`` / ``BF16``, made and cached on first use) or a path."""
    from engine.loader import default_gguf_path

    if not spec:
        return Path(default_gguf_path())
    if spec.lower() == "f32":
        return f32_gguf()
    if spec.upper() in KQUANT_TYPES + HALF_TYPES:
        return kquant_ggufs([spec.upper()])[spec.upper()]
    return Path(spec)


# ---- one greedy token per prefix (teacher-forced agreement, bench.agreement) -----------------
def llama_server_next_token(url: str, timeout_s: float = 120.0) -> Callable[[list[int]], int]:
    """llama-server's ``/completion``: token-id prompt, one greedy token, its id back."""
    client = httpx.Client(base_url=url, timeout=timeout_s)

    def next_token(prefix: list[int]) -> int:
        r = client.post("/completion", json={"prompt": prefix, "n_predict": 1, "temperature": 0.0,
                                             "ignore_eos": True, "cache_prompt": True, "return_tokens": True,
                                             "n_probs": 1})
        r.raise_for_status()
        return llama_server_token_id(r.json())

    return next_token


def llama_server_token_id(body: dict[str, Any]) -> int:
    """The generated token's id in a non-streamed ``/completion`` answer: ``tokens`` (with
    ``return_tokens``), else the top entry of ``completion_probabilities``."""
    tokens = body.get("tokens")
    if tokens:
        return int(tokens[0])
    probs = body.get("completion_probabilities") or []
    if probs and "id" in probs[0]:
        return int(probs[0]["id"])
    raise ValueError(f"no token id in llama-server's answer (keys {sorted(body)})")
