"""llama.cpp's own HTTP server (``llama-server``) as a benchmark peer.

The binary comes from Debian sid's ``llama.cpp-tools`` package, installed into a debootstrapped
sid tree that ``scripts/llama-server-peer.sh build`` makes once (root; ~3 minutes, ~180 MB)
under ``~/.cache/kvserve-bench/llama-sid-rootfs`` (``KVSERVE_BENCH_CACHE`` moves the cache,
``LLAMA_PEER_ROOTFS`` names the tree itself). The script runs the server chrooted into that
tree in a private mount namespace, on the host's loopback; this module only builds its
command line, starts it, waits for ``/health`` and stops it. Nothing here builds the tree:
a missing tree, a non-root user or a server that does not come up raise ``PeerUnavailable``
with the reason and the command that fixes it.

* ``start_llama_server(LlamaServerConfig(...))`` returns a ``bench.serving.Server``, so the
  kvserve HTTP rows' client (``run_load``: same payloads, same SSE parsing, usage from the
  final chunk) drives both servers.
* ``kquant_ggufs()`` makes real-weight K-quant files of the default model with the tree's
  ``llama-quantize`` (from the all-F32 conversion of the shipped GGUF, ``bench.llamacpp.f32_gguf``)
  and caches them next to it.
* ``gguf_weights()`` says what a GGUF file holds: its file type, the mix of tensor types
  (SmolLM2's 576-wide rows are not multiples of 256, so a "Q4_K_M" file is mostly Q5_0/Q8_0
  fallbacks) and the bytes one decode token reads (``decode_bytes``).
"""
from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from bench.llamacpp import PeerUnavailable, _file_sha256, cache_dir

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "llama-server-peer.sh"
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
                       timeout_s: float = 180.0) -> Any:
    """Start llama-server for ``cfg``; a ``bench.serving.Server`` once ``/health`` answers 200."""
    from bench.serving import launch

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


# ---- what a GGUF holds ---------------------------------------------------------------------------
def decode_bytes(tensor_bytes: Mapping[str, int]) -> int:
    """Weight bytes one decode token reads from a llama-architecture GGUF, by tensor name:
    every tensor, except that the input embedding only has one row looked up, unless the
    file has no ``output.weight`` (tied embeddings), when ``token_embd`` is the LM head and
    is read in full. The same rule as kvserve's ``decode_weight_bytes``."""
    total = sum(tensor_bytes.values())
    if "output.weight" in tensor_bytes and "token_embd.weight" in tensor_bytes:
        total -= tensor_bytes["token_embd.weight"]
    return total


def type_mix(tensors: Iterable[tuple[str, int]]) -> list[tuple[str, float]]:
    """(tensor type, share of the bytes) pairs, largest share first, from (type, bytes) pairs."""
    by_type: dict[str, int] = {}
    for kind, nbytes in tensors:
        by_type[kind] = by_type.get(kind, 0) + nbytes
    total = sum(by_type.values()) or 1
    return sorted(((k, v / total) for k, v in by_type.items()), key=lambda kv: -kv[1])


def format_label(file_type: str, mix: Sequence[tuple[str, float]], min_share: float = 0.02) -> str:
    """``Q4_K_M GGUF (Q5_0 58%, Q8_0 26%, Q6_K 16%)``: the file type and the byte shares of
    the tensor types a decode token reads (types under ``min_share`` left out)."""
    parts = [f"{k} {share:.0%}" for k, share in mix if share >= min_share]
    return f"{file_type} GGUF ({', '.join(parts)})" if parts else f"{file_type} GGUF"


def gguf_weights(path: str | os.PathLike) -> dict[str, Any]:
    """File type, decode bytes per token and the tensor-type mix of a GGUF file (parsed once
    per file version: reading a GGUF's tokenizer fields takes seconds)."""
    st = Path(path).stat()
    return dict(_gguf_weights(str(Path(path).resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=16)
def _gguf_weights(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path, "r")
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    ftype_field = reader.get_field(gguf.Keys.General.FILE_TYPE)
    file_type = "?"
    if ftype_field is not None:
        try:
            file_type = gguf.LlamaFileType(int(ftype_field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            file_type = str(ftype_field.contents())
    read = {n: b for n, b in sizes.items() if not (n == "token_embd.weight" and "output.weight" in sizes)}
    mix = type_mix((types[n], b) for n, b in read.items())
    return {"path": str(path), "file_type": file_type, "decode_bytes": decode_bytes(sizes),
            "file_bytes": Path(path).stat().st_size, "type_mix": [[k, round(s, 4)] for k, s in mix],
            "label": format_label(file_type, mix)}


# ---- K-quant files ---------------------------------------------------------------------------
def quantize_command(src: Path, dst: Path, qtype: str, threads: int = 2, script: Path = SCRIPT) -> list[str]:
    return ["bash", str(script), "quantize", str(src), str(dst), qtype, "--threads", str(threads)]


def kquant_path(source: Path, qtype: str, out_dir: Path | None = None) -> Path:
    """Where the ``qtype`` file made from ``source`` is cached (keyed by the source's hash)."""
    stem = source.stem.replace(".Q4_1", "").replace("-F32", "")
    return (out_dir or cache_dir()) / f"{stem}-{qtype}-{_file_sha256(source)[:12]}.gguf"


def kquant_ggufs(types: Sequence[str] = KQUANT_TYPES, source: str | os.PathLike | None = None,
                 threads: int = 2, timeout_s: float = 900.0) -> dict[str, Path]:
    """``{type: path}`` of the default model quantized by llama-quantize to each of ``types``,
    made once from the all-F32 conversion of the shipped GGUF (``source`` overrides it) and
    cached in the bench cache. Raises ``PeerUnavailable`` when the tree is missing."""
    from bench.llamacpp import f32_gguf

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
    from bench.llamacpp import f32_gguf
    from engine.loader import default_gguf_path

    if not spec:
        return Path(default_gguf_path())
    if spec.lower() == "f32":
        return f32_gguf()
    if spec.upper() in KQUANT_TYPES + HALF_TYPES:
        return kquant_ggufs([spec.upper()])[spec.upper()]
    return Path(spec)
