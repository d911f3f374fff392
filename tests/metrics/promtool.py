"""Find or fetch Prometheus' own tools (``promtool``, ``prometheus``) for the metrics tests.

Order: the binary on PATH; else one extracted earlier into the cache folder; else Debian's
``prometheus`` package, fetched with ``apt-get download`` (running ``apt-get update`` once if
the package lists are empty) and unpacked with ``dpkg-deb -x``: nothing is installed, no root
is needed unless the lists must be refreshed. About 2 s on a Debian host with a warm mirror
(the .deb is 19 MB). Cache: ``$KVSERVE_TEST_CACHE`` or ``~/.cache/kvserve-test``.

Never skips: a test that needs promtool fails with the reason when it cannot be had.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

PACKAGE = "prometheus"


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_TEST_CACHE") or Path.home() / ".cache" / "kvserve-test"
    return Path(root)


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def _fetch_deb(work: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError("promtool is not on PATH and this is not a Debian/Ubuntu host (no apt-get/dpkg-deb); "
                           "install Prometheus' promtool and put it on PATH")
    download = ["apt-get", "download", PACKAGE]
    done = _run(download, cwd=work)
    if done.returncode != 0:  # empty or stale package lists (fresh container): refresh once
        update = _run(["apt-get", "update"])
        if update.returncode != 0:
            raise RuntimeError(f"`apt-get download {PACKAGE}` failed ({done.stderr.strip()}) and "
                               f"`apt-get update` failed too ({update.stderr.strip()}); run it as root once")
        done = _run(download, cwd=work)
        if done.returncode != 0:
            raise RuntimeError(f"`apt-get download {PACKAGE}` failed: {done.stderr.strip()}")
    debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise RuntimeError(f"`apt-get download {PACKAGE}` left no .deb in {work}")
    return debs[-1]


@lru_cache(maxsize=None)
def prometheus_binary(name: str = "promtool") -> str:
    """Path of ``promtool`` or ``prometheus`` (both come from the same Debian package)."""
    on_path = shutil.which(name)
    if on_path:
        return on_path
    root = cache_dir()
    extracted = root / "prometheus-deb"
    binary = extracted / "usr" / "bin" / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "prometheus-deb.lock", "w") as lock:  # parallel test workers fetch once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                work = Path(tmp)
                os.chmod(work, 0o755)  # apt's _apt sandbox user may then write into it
                deb = _fetch_deb(work)
                unpacked = work / "x"
                done = _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
                if done.returncode != 0:
                    raise RuntimeError(f"dpkg-deb -x {deb} failed: {done.stderr.strip()}")
                if extracted.exists():
                    shutil.rmtree(extracted)
                os.replace(unpacked, extracted)
    if not binary.exists():
        raise RuntimeError(f"the {PACKAGE} package has no usr/bin/{name}")
    done = _run([str(binary), "--version"])
    if done.returncode != 0:
        raise RuntimeError(f"{binary} --version failed: {done.stderr.strip()}")
    return str(binary)


def promtool() -> str:
    return prometheus_binary("promtool")


if __name__ == "__main__":
    print(promtool())
