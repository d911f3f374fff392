"""Per-request sampling parameters (OpenAI / vLLM semantics) and their validation.

`SamplingParams` is the single place where request-level sampling options are checked:
once constructed, every field is in range and normalised (``top_k == -1`` becomes ``0``,
a single ``stop`` string becomes a one-element list), so the sampler and the engine can
trust it without re-validating. Every violation raises ``ValueError`` whose message names
the offending parameter, suitable for returning to an API client as a 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtypes.structured_spec import StructuredOutputSpec
from kvtypes.cache_policy import CachePolicy
from kvtypes.reasoning_spec import ReasoningSpec

# Temperatures below this are treated as 0, i.e. greedy decoding (dividing logits by a
# near-zero temperature would overflow anyway).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
_SEED_MIN = -(2**63)  # the range torch.Generator.manual_seed accepts
_SEED_MAX = 2**64 - 1


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    Contract: after ``__init__`` returns, all fields are valid and normalised;
    invalid values raise ``ValueError`` naming the parameter.
    """

    max_tokens: int | None = 16  # None = up to the context length
    temperature: float = 1.0  # 0 => greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI semantics, on output tokens, range [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI semantics, on output tokens, range [-2, 2]
    repetition_penalty: float = 1.0  # HF/CTRL semantics on prompt+output tokens (>1 discourages), > 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: logprob of the sampled token plus top-k alternatives (k <= 20)
    logprobs: int | None = None
    min_tokens: int = 0  # EOS/stop tokens are masked until this many tokens were generated
    # token id -> value added to its logit before sampling, in [-100, 100] (OpenAI semantics);
    # ids are checked against the vocabulary by the engine (validate_prompt)
    logit_bias: dict[int, float] | None = None
    # the output must match this grammar (response_format, tools, guided_*); None: free text
    structured_output: StructuredOutputSpec | None = None
    # None: no prompt logprobs; k >= 0: logprob of each prompt token (from the second on) plus
    # its top-k alternatives. Such a request skips the prefix cache: every prompt position's
    # logits must be computed.
    prompt_logprobs: int | None = None
    # Prompt-cache retention asked for (cache_control pins, prompt_cache_retention); None: plain caching
    cache_policy: CachePolicy | None = None
    # A reasoning model's think tags, budget and where the prompt left the block; None: the
    # output is not read for reasoning in the engine (no budget, grammar from the first token)
    reasoning: ReasoningSpec | None = None
    # Eviction inside the sequence (the server's --kv-eviction policy): None follows the server,
    # False opts out (the context bounds the request), True opts in (needs a policy on the server).
    kv_eviction: bool | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, minimum=1)
        self.temperature = _float_in("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        self.min_p = _float_in("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        self.presence_penalty = _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        self.min_tokens = _int("min_tokens", self.min_tokens, minimum=0)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise ValueError("structured_output must be a StructuredOutputSpec")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.cache_policy is not None and not isinstance(self.cache_policy, CachePolicy):
            raise ValueError(f"cache_policy must be a CachePolicy, got {self.cache_policy!r}")
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpec):
            raise ValueError(f"reasoning must be a ReasoningSpec, got {self.reasoning!r}")
        if self.kv_eviction is not None and not isinstance(self.kv_eviction, bool):
            raise ValueError(f"kv_eviction must be a boolean or null, got {self.kv_eviction!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature effectively 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    # bool is a subclass of int, but `top_k=True` is certainly a client bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _float_in(name: str, value: Any, low: float, high: float) -> float:
    result = _float(name, value)
    if not low <= result <= high:  # also rejects NaN
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {result}")
    return result


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    return list(stop)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None or (isinstance(bias, dict) and not bias):
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):  # JSON object keys are strings
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        token = _int("logit_bias", token, minimum=0)
        out[token] = _float_in("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return out


def _stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    return [_int("stop_token_ids", i, minimum=0) for i in ids]
