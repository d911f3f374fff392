"""llama.cpp as a peer, through the npm package ``node-llama-cpp`` (it ships a prebuilt CPU llama.cpp).

* ``f32_gguf()`` writes the default model's weights as an all-F32 GGUF (every quantized tensor
  of the shipped Q4_1 file dequantized with ``gguf.quants.dequantize``, metadata copied), so
  that llama.cpp runs exactly the numbers kvserve and transformers run. Cached under
  ``~/.cache/kvserve-bench/`` (``KVSERVE_BENCH_CACHE`` moves it), keyed by the source's hash.
* ``ensure_node_llama_cpp()`` installs the package with ``npm install`` into that cache dir
  (never into the repo) once; every later run works offline.
* ``run_llamacpp()`` runs a request list through ``bench/llamacpp_runner.mjs``: greedy, raw
  token ids in, a fixed number of output tokens, ``parallel`` sequences of one context
  batched together by node-llama-cpp; per-request first-token and last-token times come back.

Any failure raises ``PeerUnavailable`` with the reason, so the caller can report the peer
as skipped (never silently dropped).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

RUNNER = Path(__file__).resolve().parent / "llamacpp_runner.mjs"
PACKAGE = "node-llama-cpp"
MIN_NODE_MAJOR = 20


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or run here; the message is the reason."""


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_BENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvserve-bench"


# ---- weights ----------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def f32_gguf(source: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None) -> Path:
    """The all-F32 copy of ``source`` (default: the shipped SmolLM2 Q4_1 GGUF); written once."""
    if source is None:
        from engine.loader import default_gguf_path

        source = default_gguf_path()
    source = Path(source)
    out_dir = Path(out_dir) if out_dir else cache_dir()
    out = out_dir / f"{source.stem.replace('.Q4_1', '')}-F32-{_file_sha256(source)[:12]}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    convert_to_f32(source, tmp)
    tmp.replace(out)
    return out


def convert_to_f32(source: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Copy every metadata KV pair and tensor of ``source`` into ``dest``, all tensors as F32."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field is not None else "llama"
    writer = gguf.GGUFWriter(dest, arch=arch)  # writes general.architecture itself
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE,
                                                            gguf.Keys.General.FILE_TYPE):
            continue  # header fields, re-derived by the writer; the file type changes below
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            data = np.asarray(tensor.data, dtype=np.float32)
        else:
            data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # numpy order is the reverse of GGUF's ne[] order; the writer reverses it back.
        data = data.reshape([int(d) for d in reversed(tensor.shape)])
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- node ---------------------------------------------------------------------------------------
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
