"""What ``--kv-eviction`` asks for, validated; resolved against the context once the model is known."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

EVICTION_POLICIES: tuple[str, ...] = ("none", "streaming", "h2o")  # --kv-eviction; the registry implements these


@dataclass(frozen=True)
class EvictionConfig:
    """Eviction of KV blocks inside a sequence (``cache/eviction/``). Validated on construction.

    ``streaming`` (StreamingLLM): a sequence keeps its first ``sink_tokens`` tokens (rounded up
    to whole blocks) and its most recent ``window_tokens`` (whole blocks: at least that many);
    the blocks between go back to the pool. ``window_tokens`` None: half the largest window
    whose kept set plus one step's chunk fits the context (``resolve``; the rest is the room
    positions grow into between rebases). ``max_request_tokens`` caps a
    request's prompt + output when its KV is evicted (None: unlimited; the context no longer
    bounds it). ``max_positions`` (set by ``resolve``) is the position ids' bound, the context.
    """

    policy: str = "none"
    sink_tokens: int = 4
    window_tokens: int | None = None
    max_request_tokens: int | None = None
    block_size: int = 16
    budget_tokens: int | None = None  # h2o: tokens (whole blocks, rounded down) a sequence holds before a step
    recent_tokens: int | None = None  # h2o: most recent tokens always kept
    max_positions: int | None = None  # resolved: the context length
    max_chunk_tokens: int | None = None  # resolved: the most tokens one step runs for a sequence

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.policy!r}")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if self.window_tokens is not None and (not _is_int(self.window_tokens) or self.window_tokens < 1):
            raise ValueError(f"kv_window_tokens must be an integer >= 1 or unset, got {self.window_tokens!r}")
        if self.max_request_tokens is not None and (not _is_int(self.max_request_tokens)
                                                    or self.max_request_tokens < 2):
            raise ValueError(f"kv_max_request_tokens must be an integer >= 2 or unset, got {self.max_request_tokens!r}")
        for key in ("budget_tokens", "recent_tokens"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"kv_{key} must be an integer >= 0 or unset, got {value!r}")
        if self.policy == "h2o":
            if self.budget_tokens is None:
                raise ValueError("kv_eviction 'h2o' needs kv_budget_tokens (--kv-budget-tokens)")
            if self.window_tokens is not None:
                raise ValueError("kv_window_tokens is for kv_eviction 'streaming'; h2o keeps kv_recent_tokens")
            least = (self.sink_blocks + self.recent_blocks + 2) * self.block_size
            if self.budget_blocks * self.block_size < least:
                raise ValueError(
                    f"kv_budget_tokens {self.budget_tokens} leaves no heavy-hitter block: h2o keeps "
                    f"{self.sink_blocks} sink blocks, {self.recent_blocks} recent blocks and the open block, so the "
                    f"budget must be at least {least} tokens with block_size {self.block_size}")
        elif self.budget_tokens is not None or self.recent_tokens is not None:
            raise ValueError("kv_budget_tokens and kv_recent_tokens are for kv_eviction 'h2o'")
        if self.max_positions is not None and self.policy != "h2o":
            held = self.max_held_tokens
            if held > self.max_positions:
                raise ValueError(
                    f"kv_sink_tokens {self.sink_tokens} (as {self.sink_blocks} blocks) + kv_window_tokens "
                    f"{self.window_tokens} + one step's chunk ({self.max_chunk_tokens}) need {held} positions, "
                    f"more than the context of {self.max_positions}; lower kv_window_tokens or "
                    "max_num_batched_tokens")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    @property
    def budget_blocks(self) -> int:
        """h2o: the most blocks a sequence holds before a step (the open one included)."""
        return (self.budget_tokens or 0) // self.block_size

    @property
    def recent_blocks(self) -> int:
        """h2o: whole blocks the recent tokens may touch beside the open block."""
        if self.recent_tokens is not None:
            return -(-self.recent_tokens // self.block_size)
        return max(0, (self.budget_blocks - self.sink_blocks - 1) // 2)

    @property
    def max_held_tokens(self) -> int:
        """The most tokens one sequence holds (and the largest position id + 1 after a rebase):
        its sink blocks, its window rounded out to whole blocks, one step's chunk (h2o: its budget
        in whole blocks and one step's chunk)."""
        if self.policy == "h2o":
            assert self.max_chunk_tokens is not None
            return self.budget_blocks * self.block_size + self.max_chunk_tokens
        assert self.window_tokens is not None and self.max_chunk_tokens is not None
        return self.sink_blocks * self.block_size + self.window_tokens + self.block_size - 1 + self.max_chunk_tokens

    def resolve(self, max_positions: int, max_chunk_tokens: int) -> EvictionConfig:
        """This config against the context (``max_positions``) and the step's token budget:
        the default window filled in, ValueError when the kept set cannot fit the context."""
        if not self.enabled:
            return self
        if self.policy == "h2o":  # keys stay at their text positions: the context bounds a request
            recent = self.recent_tokens if self.recent_tokens is not None else self.recent_blocks * self.block_size
            cap = min(self.max_request_tokens or max_positions, max_positions)
            return dataclasses.replace(self, recent_tokens=recent, max_request_tokens=cap,
                                       max_positions=max_positions, max_chunk_tokens=max_chunk_tokens)
        window = self.window_tokens
        if window is None:
            # Half of what fits: the other half is the slack that positions grow into between two
            # rebases, so a rebase (rotating the window's keys) comes once per ~window tokens.
            fits = max_positions - self.sink_blocks * self.block_size - (self.block_size - 1) - max_chunk_tokens
            window = fits // 2 - (fits // 2) % self.block_size
            if window < self.block_size:
                raise ValueError(f"the context of {max_positions} leaves no window for kv_eviction "
                                 f"{self.policy!r} beside {self.sink_blocks} sink blocks and a {max_chunk_tokens}-token "
                                 "chunk; lower max_num_batched_tokens")
        return dataclasses.replace(self, window_tokens=window, max_positions=max_positions,
                                   max_chunk_tokens=max_chunk_tokens)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
