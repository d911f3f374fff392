"""What ships is what runs: the wheel and both images carry every package and every kernel file.

A non-editable install (the images run ``pip install .``) that lacked a package failed at the
first import (the images once had no ``kvtypes`` or ``kvserve``), and one that lacked a kernel
header could not compile the native kernels and silently served on the slow torch paths.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile

import pytest
from setuptools import find_packages

from tests.deploy.test_static_deploy import DOCKERFILES, ROOT, dockerignore_excludes, instructions

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INCLUDE = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
PACKAGES = sorted(find_packages(str(ROOT), include=INCLUDE))
TOP_LEVEL = sorted({p.split(".")[0] for p in PACKAGES})
KERNEL_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "engine/kernels/cpu").iterdir()
                      if p.suffix in (".cpp", ".h"))


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: the wheel is built from the tracked files")
    return [f for f in out.stdout.split("\0") if f and (ROOT / f).is_file()]


def test_every_top_level_python_package_is_in_packages_find():
    on_disk = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    assert on_disk == TOP_LEVEL, "a product folder is missing from pyproject's packages.find"
    assert {"kvtypes", "configs", "cache", "scheduler", "engine", "server", "kvserve", "bench"} <= set(TOP_LEVEL)
    assert KERNEL_FILES and any(f.endswith(".h") for f in KERNEL_FILES)


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names inside ``pip wheel --no-deps .``, built from a copy of the tracked files
    (so the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for f in tracked_files():
        target = src / f
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / f).read_bytes())
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = out.glob("kvserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_holds_every_package_module_and_kernel_file(wheel_names):
    for package in PACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in wheel_names, package
    modules = [f for f in tracked_files() if f.endswith(".py") and f.split("/")[0] in TOP_LEVEL]
    missing = [m for m in modules if m not in wheel_names]
    assert not missing, f"modules left out of the wheel: {missing}"
    missing = [k for k in KERNEL_FILES if k not in wheel_names]
    assert not missing, f"kernel sources/headers left out of the wheel: {missing}"
    # every other file a package holds is read at run time too (profiles, the peer's runner, ...)
    data = [f for f in tracked_files() if f.split("/")[0] in TOP_LEVEL and not f.endswith(".py")]
    assert "configs/cpu.yaml" in data and "bench/peers/node_llama_cpp_runner.mjs" in data
    missing = [f for f in data if f not in wheel_names]
    assert not missing, f"package data left out of the wheel: {missing}"


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES))
def test_each_dockerfile_copies_every_package(dockerfile):
    copied = set()
    for keyword, args in instructions(dockerfile):
        if keyword == "COPY" and not args.startswith("--from"):
            copied |= {src.rstrip("/") for src in args.split()[:-1]}
    missing = [p for p in TOP_LEVEL if p not in copied]
    assert not missing, f"{dockerfile} does not copy {missing}"
    for package in TOP_LEVEL:
        assert not dockerignore_excludes(package), f".dockerignore leaves {package}/ out of the build context"
        assert not dockerignore_excludes(f"{package}/__init__.py")
    for kernel in KERNEL_FILES:
        assert not dockerignore_excludes(kernel), kernel
