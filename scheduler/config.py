"""Scheduler knobs, with defaults sized for a 2-core CPU."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix")  # the drafters' registry (scheduler/drafting) has one each
# Keys that only one method reads; the others are common to every method.
METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
}


@dataclass
class SpeculativeConfig:
    """Draft-free speculative decoding, in vLLM's ``--speculative-config`` shape.

    ``ngram`` (prompt lookup): a running request proposes up to ``num_speculative_tokens``
    draft tokens: the tokens that followed the most recent earlier occurrence of its longest
    trailing n-gram, ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens long, in its
    prompt + output (scheduler/drafting/ngram.py). ``suffix``: the most frequent continuation of
    its longest matching suffix in its prompt + output and recent requests' outputs
    (scheduler/drafting/suffix.py, the ``suffix_decoding_*`` keys). One forward pass verifies the
    draft (engine/sampling/verification.py). Per step the adaptive rule decides who drafts
    (``verify_cost_ratio``, ``disable_by_batch_size``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # The adaptive rule (scheduler/speculative.py, ``choose_speculators``): a verify step's cost in
    # plain decode steps. Measured on the default model, 2 threads, CPU defaults: a 5-token verify
    # row on the native decode path costs 1.4-1.6 native 1-token rows (every draft verified, bench
    # probe spec_decode: copy prompts 2.36 tokens a step at 1.52x, chat 1.50 at 1.08x), so 1.5;
    # where the verify rows ran on the Python layers it was 3.0. Where plain decode is not native
    # (decode_path python, GPU) a verify step costs about one plain step: ~1.2. 0: speculate
    # whenever a draft exists.
    verify_cost_ratio: float = 1.5
    # vLLM's name: no request speculates in a step that runs more decoding requests than this
    # (None: no cutoff). At a large batch the plain step is already compute-bound.
    disable_by_batch_size: int | None = 8
    # suffix (vLLM's names): the longest suffix matched, in tokens; completed requests whose outputs
    # stay drafted from (vLLM: 10000; here each cached token costs an index entry in Python, so
    # fewer); a draft is at most this factor times the match length; a draft stops before a token
    # whose estimated probability (a product of continuation frequencies) is below this.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        depth = self.suffix_decoding_max_tree_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"speculative_config.suffix_decoding_max_tree_depth must be an integer >= 2, "
                             f"got {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0, "
                             f"got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be a number in [0, 1], "
                             f"got {prob!r}")
        ratio = self.verify_cost_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < float("inf"):
            raise ValueError(f"speculative_config.verify_cost_ratio must be a number >= 0, got {ratio!r}")
        cutoff = self.disable_by_batch_size
        if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 or null, "
                             f"got {cutoff!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a flag's JSON text, a profile's mapping, a config or None (off); ValueError names
        what is wrong (an unknown key, method or value)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        if "method" not in value:
            raise ValueError("speculative_config needs a method (one of: " + ", ".join(SPECULATIVE_METHODS) + ")")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown key(s) in speculative_config: {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(sorted(known))})")
        for method, keys in METHOD_KEYS.items():
            foreign = [key for key in keys if key in value and method != value["method"]]
            if foreign and value["method"] in METHOD_KEYS:
                raise ValueError(f"speculative_config.{foreign[0]} applies to method {method}, not "
                                 f"{value['method']}")
        return cls(**value)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one engine step (decodes + prefill chunks)
    max_num_seqs: int = 64  # running requests at most
    max_model_len: int | None = None  # context length (prompt + output); None: resolved from the model
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority" (lower value first, then arrival)
    # None: off. A SpeculativeConfig, or its JSON text / mapping (flag, profile), parsed here.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.max_model_len is None:
            return
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})")
