"""kvserve's cache folders on disk, and how a folder in them is published whole.

Leaf module (standard library only): the loader keeps converted checkpoints here and the
kernels their compiled library, so neither imports the other to find a folder.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def conversion_cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")
    return Path(root)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish_dir(target: Path, fill: Callable[[Path], None]) -> Path:
    """Make the cache folder ``target`` whole or not at all: ``fill`` writes into a temporary
    sibling, which is then renamed. A concurrent process that finished first wins (its folder,
    with a ``config.json``, stays); a crash leaves no half-written ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; a container's non-root user must read it
    try:
        fill(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
