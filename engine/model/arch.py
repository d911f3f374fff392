"""The architecture numbers of a Llama-family checkpoint, read once from its HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this engine can run."""


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelArch":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}: kvserve runs {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {config.hidden_act!r} (only silu)")
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", model_type == "mistral") \
                and window < config.max_position_embeddings:
            raise UnsupportedModelError(f"sliding-window attention ({window} tokens) is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        eos = config.eos_token_id
        eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else eos))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", model_type == "qwen2")),
            eos_token_ids=eos_ids,
        )
