"""HTTP-side configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.log_format import check_log_format


@dataclass
class ResponseStoreConfig:
    """The bounded in-memory store of finished ``/v1/responses`` (least recently used evicted
    first when either cap is reached; an evicted id answers 404 like an unknown one)."""

    max_responses: int = 1024
    max_bytes: int = 64 * 1024 * 1024  # of the stored JSON (responses and their conversations)

    def __post_init__(self) -> None:
        if self.max_responses < 0 or self.max_bytes < 0:
            raise ValueError("response_store caps must be >= 0 (0 stores nothing)")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # also from KVSERVE_API_KEY; None: no authentication
    api_key_file: str | None = None  # YAML tenants (server/tenants/config.py); excludes api_key
    max_waiting: int = 256  # requests queued beyond this get 429 + Retry-After
    max_body_bytes: int = 2 * 1024 * 1024
    max_n: int = 8  # choices per request
    max_prompts: int = 32  # prompts in one /v1/completions request (checked before tokenizing)
    max_prompt_chars: int = 1_000_000  # characters of prompt text per request (checked before tokenizing)
    max_stop: int = 16  # stop strings per request
    shutdown_grace_s: float = 20.0  # SIGTERM: in-flight requests may finish for this long
    log_stats_interval_s: float = 10.0  # periodic throughput/KV log line while busy; 0 disables
    metrics_compat: str | None = None  # "vllm": also export the vLLM metric names routers read
    log_format: str = "text"  # "json": every log line (the access log's too) a JSON object (server/access_log.py)
    response_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_prompts < 1 or self.max_prompt_chars < 1:
            raise ValueError("max_prompts and max_prompt_chars must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.metrics_compat not in (None, "vllm"):
            raise ValueError(f"metrics_compat must be 'vllm' or null, got {self.metrics_compat!r}")
        check_log_format(self.log_format)
        if isinstance(self.response_store, dict):  # from a YAML profile's server section
            self.response_store = ResponseStoreConfig(**self.response_store)
        if self.api_key == "":
            self.api_key = None
        if self.api_key is not None and self.api_key_file:
            raise ValueError("api_key and api_key_file exclude each other (put that key in the key file)")
