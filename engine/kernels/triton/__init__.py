"""Triton kernels (GPU; on a CPU they run under ``TRITON_INTERPRET=1``, which the tests use).

Importing this package never fails; ``triton_available()`` says whether the kernels can be
built and why not.
"""
from __future__ import annotations

import importlib.util
import os


def triton_unavailable(device_type: str) -> str | None:
    """None when Triton kernels can run on ``device_type``, else the reason."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'kvserve[gpu]')"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter runs kernels on CPU tensors (tests)
    return f"Triton kernels run on CUDA devices (on {device_type} only under TRITON_INTERPRET=1, for tests)"
