"""The messages between the engine core and its client, and what the client knows of the core.

Plain picklable dataclasses, no torch: the frontend process imports this without the model;
``pipe_poller``, how both ends ask their pipe whether a message is waiting, and
``MessageReader``, how the frontend reads the core's messages off its pipe.
Direction and order: the client sends ``AddRequest`` / ``AbortRequests`` / ``Unpin`` /
``Shutdown``; the core answers once with ``CoreReady`` and then, per step, with one
``EngineCoreOutputs`` (every request's new token ids and finish state, plus ONE ``StepStats``
snapshot). While idle the core also sends a stats-only message when the pins or the KV tier
counters changed (pin expiry, an ``Unpin``, disk writes finishing), so the frontend's view of
them never lags by more than the idle poll.
"""
from __future__ import annotations

import dataclasses
import math
import os
# bandit B403: the frontend reads the pickles of its own engine core's pipe (MessageReader)
import pickle  # nosec B403
import select
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvtypes.outputs import TokenLogprob
from kvtypes.sampling_params import SamplingParams

# What clients see when the engine fails; the detail goes to the server log only.
GENERIC_ENGINE_ERROR = "the engine failed while processing this request; retry it later"


def pipe_poller(conn: Any) -> Callable[[float], bool]:
    """``conn.poll(timeout)`` for a multiprocessing Connection (seconds; True when a message, or
    the end of the pipe, is there to ``recv``) on one ``select.poll`` object made here:
    ``Connection.poll`` builds and registers a selector on every call, which each engine step
    (the core) and each streamed token (the frontend) paid."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda timeout: bool(poller.poll(timeout * 1000.0))


class MessageReader:
    """The messages on the read end ``conn`` of a pipe that ``multiprocessing``'s ``Connection.send``
    writes (frames of a 4-byte big-endian length, or -1 and an 8-byte length, then the pickle).

    ``read`` takes what the pipe holds in one ``os.read`` and returns the whole messages in it,
    in order; the bytes of a message not yet complete wait here for the next ``read``. So whoever
    holds the reader (the supervisor thread, or the event loop when its fd turns readable) may
    change between any two reads, and a step costs one system call. (``Connection.recv`` reads a
    frame's length and its body in two, and the reader polled again after each message: four a
    step on the frontend's event loop.) Call ``read`` only when ``poll`` or the event loop said the
    pipe is readable: the fd blocks. Raises EOFError at the pipe's end."""

    # At most this much a read: os.read allocates its size and then shrinks the bytes to what came,
    # which for a buffer past glibc's mmap threshold (128 KB) is a mapping made and remapped every
    # step: a 300-byte message cost 13-15 us at 256 KB or 1 MB against 1.1 us at 64 KB (warm). A
    # larger message takes several reads, its frame assembled across them as any partial one.
    READ_SIZE = 1 << 16

    def __init__(self, conn: Any) -> None:
        self.conn = conn  # owns the fd: closing it ends the reader
        self.fd = conn.fileno()
        self.poll = pipe_poller(conn)
        self._parts: list[bytes] = []  # an incomplete frame's bytes so far
        self._held = 0  # their length
        self._needed = 0  # the length of the whole frame, once its header is there (else 0)

    def read(self) -> list[Any]:
        data = os.read(self.fd, self.READ_SIZE)
        if not data:
            raise EOFError("the pipe ended")
        if self._parts:
            self._parts.append(data)
            self._held += len(data)
            if self._held < self._needed:
                return []
            data = b"".join(self._parts)
            self._parts = []
        messages = []
        view, end, pos = memoryview(data), len(data), 0
        while True:
            needed = 0
            if end - pos >= 4:
                size, head = struct.unpack_from("!i", data, pos)[0], 4
                if size == -1 and end - pos >= 12:
                    size, head = struct.unpack_from("!Q", data, pos + 4)[0], 12
                if size != -1:
                    needed = head + size
                    if pos + needed <= end:
                        # bandit B301: the bytes come from the core process this client spawned, as
                        # multiprocessing's own recv would unpickle them
                        messages.append(pickle.loads(view[pos + head:pos + needed]))  # nosec B301
                        pos += needed
                        continue
            if pos < end:
                rest = data[pos:]
                self._parts, self._held, self._needed = [rest], len(rest), needed
            return messages


def positional_pickle(cls: type) -> type:
    """Pickle the dataclass ``cls`` as its class and its field values in order, rebuilt by its
    ``__init__``: pickle's default for a dataclass writes every field's name beside its value
    for every object, which made a step's message 4x the bytes and its ``loads`` (on the
    frontend's event loop, once a step) 2-3x the time at 16 requests. Every field must be an
    ``__init__`` argument, and no other attribute may be set on an object that is sent (its
    rebuild would then fail loudly)."""
    if not all(f.init for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__name__}: every field must be an __init__ argument")

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        # the dataclass __init__ sets the fields in their order, which a dict keeps
        return cls, tuple(self.__dict__.values())

    cls.__reduce__ = __reduce__
    return cls


class PromptTooLongError(ValueError):
    """Prompt (plus requested output) does not fit the context or the KV pool."""


@dataclass(frozen=True)
class EngineInfo:
    """Immutable facts about the served model and pool, for validation and metrics labels."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    dtype: str
    enable_prefix_caching: bool
    has_tokenizer: bool = True  # structured output needs one
    has_disk_tier: bool = False  # prompt_cache_retention '24h' needs one
    kv_bytes_per_token: int = 0  # of the device pool (int8 KV included)
    kv_cache_dtype: str = "auto"
    max_pinned_blocks: int = 0
    scheduling_policy: str = "fcfs"  # "priority": the request field ``priority`` orders admission
    # Eviction inside a sequence (cache/eviction): the policy, the cap on an evicting request's
    # prompt + output (None: unlimited) and the most tokens such a request holds in the pool.
    kv_eviction: str = "none"
    kv_max_request_tokens: int | None = None
    kv_max_held_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def evicts(self, params: SamplingParams) -> bool:
        """Whether the eviction policy applies to a request (its ``kv_eviction`` or the server's);
        ValueError when it opts in and the server runs none."""
        if params.kv_eviction and self.kv_eviction == "none":
            raise ValueError("kv_eviction: this server evicts no KV (start it with --kv-eviction streaming or h2o)")
        return self.kv_eviction != "none" and params.kv_eviction is not False

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (PromptTooLongError for length) with a client-facing message."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        bad_bias = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias token id {bad_bias[0]} is out of range [0, {self.vocab_size})")
        if params.structured_output is not None and not self.has_tokenizer:
            raise ValueError("structured output needs a tokenizer; this engine has none")
        if self.evicts(params):
            self._validate_evicting(n, params)
            return
        if n >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens but the context length is {self.max_model_len} "
                                     "tokens (at least one must be left to generate)")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n + params.max_tokens} "
                f"were requested ({n} in the prompt, {params.max_tokens} to generate)")
        need = n + (params.max_tokens or self.max_model_len - n)
        if math.ceil(need / self.block_size) > self.num_blocks:
            raise PromptTooLongError(
                f"the request needs up to {need} tokens of KV cache but the pool holds only "
                f"{self.num_tokens} ({self.num_blocks} blocks); raise --num-blocks or "
                "--kv-cache-memory, or ask for fewer tokens")


    def _validate_evicting(self, n: int, params: SamplingParams) -> None:
        """An evicting request: its own cap bounds prompt + output, and it holds at most
        ``kv_max_held_tokens`` of the pool whatever its length."""
        cap = self.kv_max_request_tokens
        if cap is not None and n >= cap:
            raise PromptTooLongError(f"the prompt has {n} tokens but a request may hold at most {cap} "
                                     "(--kv-max-request-tokens, under h2o at most the context; at least one must be left to generate)")
        if cap is not None and params.max_tokens is not None and n + params.max_tokens > cap:
            raise PromptTooLongError(f"a request may hold at most {cap} tokens (--kv-max-request-tokens, under h2o at most the "
                                     f"context), but "
                                     f"{n + params.max_tokens} were requested ({n} in the prompt, "
                                     f"{params.max_tokens} to generate)")
        if math.ceil(self.kv_max_held_tokens / self.block_size) > self.num_blocks:
            raise PromptTooLongError(f"a sequence under kv_eviction {self.kv_eviction!r} holds up to "
                                     f"{self.kv_max_held_tokens} tokens of KV cache but the pool holds only "
                                     f"{self.num_tokens}; raise --num-blocks or lower --kv-window-tokens")


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)  # CLOCK_MONOTONIC is system-wide
    tenant: str | None = None  # the tenant's name (server/tenants): fair admission, pin ownership


@dataclass
class AbortRequests:
    """End these requests now. ``stopped``: a stop string finished them in the frontend, so the
    core finishes them as ``stop`` (their cache policy - pins, retention - applies as for any
    normal finish); otherwise they end as ``abort``."""

    request_ids: list[str]
    stopped: bool = False


@dataclass
class Unpin:
    """Release the pin whose last-block hash is ``block_hash`` (hex) at the next scheduling step;
    fire and forget: an unknown hash is ignored (the frontend answers 404 from its snapshot)."""

    block_hash: str


@dataclass
class Shutdown:
    """Abort everything (the requests end with ``abort``), send the last outputs, exit."""


@dataclass
class CoreReady:
    info: EngineInfo
    tokenizer: Any  # the HF tokenizer, or None (token-id-only models)
    pid: int


@positional_pickle
@dataclass
class EngineCoreOutput:
    """One request's news from one step. ``finish_reason`` is set on its last output only."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | None = None  # the stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0  # tokens written into retained cache (pins, 24h retention)
    num_evicted_tokens: int = 0  # tokens whose KV the eviction policy dropped (cache/eviction)
    first_scheduled_time: float | None = None
    # On the first output of a request that asked for prompt logprobs (see RequestOutput)
    prompt_logprobs: list[TokenLogprob] | None = None
    # A client-caused failure the client may see (an invalid grammar); engine faults leave it
    # None and the output processor sends GENERIC_ENGINE_ERROR instead
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PinSnapshot:
    """One live pin as the frontend lists it (``GET /v1/cache``); ``ttl_left_s`` at ``StepStats.time``."""

    hash: str
    num_tokens: int
    num_blocks: int
    ttl_s: float
    ttl_left_s: float
    salt_id: str | None = None
    tenant: str | None = None  # whose request pinned it (None: no tenants)


@positional_pickle
@dataclass
class StepStats:
    """The scheduler and KV pool after a step. Gauges are absolute; counters are deltas since
    the previous snapshot, so a restarted core (whose own counters start at 0) never makes a
    frontend counter go backwards."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_cached_blocks: int = 0  # free blocks still hashed (evictable prefix-cache entries)
    kv_num_blocks: int = 0
    kv_block_size: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_batched_tokens: int = 0
    step_time_s: float = 0.0
    # KV tiers (cache/tiers.py), keyed by tier name: tokens looked up / found ("device", "host",
    # "disk") and the lower tiers' payload bytes read / written are deltas; usage, capacity and
    # pins are gauges; each lower tier's per-block write / read latencies observed since the
    # previous snapshot come as lists.
    tier_queries: dict[str, int] = field(default_factory=dict)
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_bytes_read: dict[str, int] = field(default_factory=dict)
    tier_bytes_written: dict[str, int] = field(default_factory=dict)
    tier_usage_bytes: dict[str, int] = field(default_factory=dict)
    tier_capacity_bytes: dict[str, int] = field(default_factory=dict)
    offload_write_seconds: dict[str, list[float]] = field(default_factory=dict)
    offload_read_seconds: dict[str, list[float]] = field(default_factory=dict)
    kv_pinned_blocks: int = 0
    pins: tuple[PinSnapshot, ...] = ()
    # Speculative decoding (deltas, vLLM's four counters): drafts verified, their tokens, of those
    # the accepted ones, and per draft position i the drafts whose token i was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Eviction inside sequences (cache/eviction): blocks evicted (delta), and over the live
    # evicting requests the tokens they computed and the tokens they hold (gauges).
    kv_evicted_blocks: int = 0
    kv_eviction_seen_tokens: int = 0
    kv_eviction_held_tokens: int = 0
    time: float = field(default_factory=time.monotonic)  # when the snapshot was taken (CLOCK_MONOTONIC)

    @property
    def kv_used_tokens(self) -> int:
        return self.kv_used_blocks * self.kv_block_size

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_num_blocks if self.kv_num_blocks else 0.0


@positional_pickle
@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: StepStats | None = None
