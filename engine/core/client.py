"""The frontend's side of the engine core: one ``EngineClient`` interface, two implementations.

- ``MPEngineClient`` (``engine.core.process_client``, the served default) runs the core in a process of its own (started with
  'spawn': torch and fork do not mix) and talks to it over two one-way
  ``multiprocessing`` pipes with pickle (chosen by measurement: ``python -m bench.probes.ipc_transport``,
  numbers in docs/architecture.md). A sender thread writes the commands, so a full pipe never
  blocks the event loop. The step outputs are read by the server's event loop itself once
  ``bind_loop`` gave it one (a reader on the pipe: no thread hop and no self-pipe wake-up per
  step, the frontend's main per-token cost); before that, or without a loop, by the supervisor
  thread, which also watches the process and restarts it. Exactly one of them reads at a time.
- ``InprocEngineClient`` runs the same core loop (``EngineCore.run``) in a thread of this
  process (tests, benches).

Both share the frontend half (``_ClientBase``): ``generate`` (an async iterator) and ``push`` (a
sink called with each output; what streamed responses use) register a stream and the request
in the ``OutputProcessor`` (detokenization, stop strings: the one place), each step's outputs
are processed in the receiving thread and handed to the streams' event loops (directly when that
is the loop reading, else with one ``call_soon_threadsafe`` per loop), requests a stop string
finished are aborted in the core, and
the observer (metrics) gets each step's ``StepStats`` snapshot and ``RequestOutput``s. Nothing
here reads engine state across threads.

Faults (process mode): when the core process dies, every open stream gets a final ``error``
output at once (the pipe's EOF), ``is_healthy`` is False while a new core loads, then True.
After ``EngineCoreConfig.max_failures`` deaths within ``failure_window_s`` the client stops
restarting, sets ``fatal`` and calls ``on_fatal`` (the server then exits non-zero).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from engine.core.protocol import (GENERIC_ENGINE_ERROR, AbortRequests, AddRequest, EngineCoreOutputs, EngineInfo,
                                  Shutdown, StepStats, Unpin)
from engine.core.output_processor import OutputProcessor
from kvtypes.outputs import RequestOutput
from kvtypes.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core is not running (stopped, restarting, or given up); no request can be served now."""


class EngineObserver(Protocol):
    """Receives, in the client's receiving thread, each step's stats snapshot (None when the
    message carried no step) and the ``RequestOutput``s made of it (metrics, logging)."""

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None: ...


class EngineClient(Protocol):
    info: EngineInfo
    tokenizer: Any
    observer: EngineObserver | None
    fatal: bool

    @property
    def model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def is_healthy(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def stats(self) -> StepStats | None: ...

    def start(self) -> None: ...
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None: ...
    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                 cache_salt: str | None = None, priority: int = 0,
                 tenant: str | None = None) -> AsyncIterator[RequestOutput]: ...
    def push(self, prompt_token_ids: Sequence[int], params: SamplingParams, sink: Callable[[RequestOutput], None],
             request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
             tenant: str | None = None) -> Callable[[bool], None]: ...
    def unpin(self, block_hash: str) -> None: ...


class _Stream:
    """One request's outputs, on the event loop of its ``generate``: ``put`` (called on that loop)
    wakes the one reader that ``get`` awaits. An ``asyncio.Queue`` does the same with more of the
    frontend's CPU a token."""

    __slots__ = ("loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, out: RequestOutput) -> None:
        self._items.append(out)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class _Pushed:
    """One ``push``ed request's outputs: ``put`` (called on ``loop``, as ``_Stream.put``) is the
    caller's sink itself."""

    __slots__ = ("loop", "put")

    def __init__(self, loop: asyncio.AbstractEventLoop, sink: Callable[[RequestOutput], None]) -> None:
        self.loop, self.put = loop, sink


class _ClientBase:
    """Streams, output processing and observer calls shared by both clients (see the module doc)."""

    info: EngineInfo
    tokenizer: Any

    def __init__(self, observer: EngineObserver | None = None) -> None:
        self.observer = observer
        self.fatal = False
        self._streams: dict[str, _Stream | _Pushed] = {}
        self._lock = threading.Lock()  # guards _streams, _processor and _epoch
        self._processor: OutputProcessor | None = None
        self._epoch = 0  # bumped when a core dies: commands for the old core are dropped
        self._stats: StepStats | None = None
        self.num_steps = 0  # steps that ran tokens, as reported by the core

    # ---- what the server reads -------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def stats(self) -> StepStats | None:
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Engine requests accepted and not running (still queued to the core included)."""
        running = self._stats.num_running if self._stats is not None else 0
        return max(0, len(self._streams) - running)

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.info.validate(prompt_token_ids, params)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tell the client which event loop serves (process mode reads the outputs on it)."""

    # ---- generate ------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None, priority: int = 0,
                       tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the iterator aborts the request."""
        stream = _Stream(asyncio.get_running_loop())
        close = self._open(prompt_token_ids, params, stream, request_id, cache_salt, priority, tenant)
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            close(finished)

    def push(self, prompt_token_ids: Sequence[int], params: SamplingParams, sink: Callable[[RequestOutput], None],
             request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
             tenant: str | None = None) -> Callable[[bool], None]:
        """Run a request whose outputs go to ``sink(out)`` as they come, called on this event loop
        where each step's outputs are handed over (no task or queue between the engine and the
        caller; ``sink`` must not raise). Returns ``close(finished)``: call it exactly once, with
        whether the last output was seen; without it the request is aborted."""
        return self._open(prompt_token_ids, params, _Pushed(asyncio.get_running_loop(), sink), request_id,
                          cache_salt, priority, tenant)

    def _open(self, prompt_token_ids: Sequence[int], params: SamplingParams, stream: _Stream | _Pushed,
              request_id: str | None, cache_salt: str | None, priority: int,
              tenant: str | None) -> Callable[[bool], None]:
        """Register ``stream`` and send the request; returns its ``close(finished)``."""
        self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        add = AddRequest(request_id, list(prompt_token_ids), params, cache_salt, priority, time.monotonic(), tenant)
        with self._lock:
            if not self.is_healthy:
                raise EngineDeadError("the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._processor.add_request(request_id, add.prompt_token_ids, params, add.arrival_time)
            epoch = self._epoch
        self._send(add, epoch)

        def close(finished: bool) -> None:
            with self._lock:
                self._streams.pop(request_id, None)
                aborted = self._processor.finish(request_id, "abort")
            if not finished:
                self._send(AbortRequests([request_id]), epoch)
            if aborted is not None:  # the caller left: metrics count it here (the core's answer is dropped)
                self._observe(None, [aborted])
        return close

    def abort(self, request_id: str) -> None:
        self._send(AbortRequests([request_id]), self._epoch)

    def unpin(self, block_hash: str) -> None:
        """Ask the core to release a pin (fire and forget; the next snapshot shows the result)."""
        self._send(Unpin(block_hash), self._epoch)

    # ---- the receiving thread ------------------------------------------------------------------
    def _on_outputs(self, message: EngineCoreOutputs, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """One message from the core; ``loop``: the event loop this runs on, when the caller knows
        it (the loop's own pipe reader: asking asyncio costs a system call a step)."""
        with self._lock:
            outputs, stopped = self._processor.process(message.outputs)
            epoch = self._epoch
            targets = self._targets(outputs)
        if stopped:
            self._send(AbortRequests(stopped, stopped=True), epoch)
        if message.stats is not None:
            self._stats = message.stats
            if message.stats.num_batched_tokens:
                self.num_steps += 1
        _hand_over(targets, loop)
        self._observe(message.stats, outputs)

    def _fail_all(self, finish_reason: str, message: str | None, reset_stats: bool = False) -> None:
        """Give every open stream a final output; with ``reset_stats``, a dead core's gauges read zero."""
        with self._lock:
            self._epoch += 1
            outputs = self._processor.finish_all(finish_reason, message) if self._processor is not None else []
            targets = self._targets(outputs)
        stats = None
        if reset_stats:
            stats = self._stats = StepStats(kv_num_blocks=self.info.num_blocks, kv_block_size=self.info.block_size)
        _hand_over(targets)
        self._observe(stats, outputs)

    def _targets(self, outputs: list[RequestOutput]) -> list[tuple[_Stream | _Pushed, RequestOutput]]:
        """The open stream of each output (caller holds the lock); outputs nobody reads are dropped."""
        streams = self._streams
        return [(stream, out) for out in outputs if (stream := streams.get(out.request_id)) is not None]

    def _observe(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        if self.observer is not None and (stats is not None or outputs):
            try:
                self.observer.on_step(stats, outputs)
            except Exception:  # noqa: BLE001 - an observer bug must never stop the outputs
                logger.exception("engine observer failed")

    def _send(self, command: AddRequest | AbortRequests | Unpin | Shutdown, epoch: int) -> None:
        raise NotImplementedError


def _hand_over(targets: list[tuple[_Stream | _Pushed, RequestOutput]],
               here: asyncio.AbstractEventLoop | None = None) -> None:
    """Put each output into its stream: directly when read on that stream's loop (``here``, else
    the running loop, if any; bind_loop), else through that loop's ``call_soon_threadsafe``."""
    if here is None and targets:
        here = _running_loop()
    elsewhere: dict[asyncio.AbstractEventLoop, list[tuple[_Stream | _Pushed, RequestOutput]]] = {}
    for stream, out in targets:
        if stream.loop is here:
            stream.put(out)
        else:
            elsewhere.setdefault(stream.loop, []).append((stream, out))
    for loop, items in elsewhere.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[_Stream | _Pushed, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put(out)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# ==== in-process ===================================================================================
class InprocEngineClient(_ClientBase):
    """The core loop in a thread of this process, around a given ``LLMEngine`` (no restart)."""

    def __init__(self, engine: Any, observer: EngineObserver | None = None) -> None:
        super().__init__(observer)
        self.engine = engine  # for tests and benches: only the loop thread may touch it once started
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self._processor = OutputProcessor(self.tokenizer)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._thread is None:
            from engine.platform.openmp import release_openmp_threads

            # The model was built on this thread; its OpenMP workers would halve the loop's speed.
            release_openmp_threads()
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("abort", None)

    @property
    def is_healthy(self) -> bool:
        return (self.error is None and not self._stop.is_set() and self._thread is not None
                and self._thread.is_alive())

    def _send(self, command: AddRequest | AbortRequests | Unpin | Shutdown, epoch: int) -> None:
        self._commands.put(command)

    def _receive(self, timeout: float) -> list:
        try:
            commands = [self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        from engine.core.loop import EngineCore

        try:
            config = getattr(self.engine, "config", None)  # tests drive the loop with stand-in engines
            burst_gap_s = config.core.burst_gap_ms / 1e3 if config is not None else 0.0
            EngineCore(self.engine, burst_gap_s).run(self._receive, self._on_outputs, self._stop.is_set)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            logger.exception("engine loop failed")
            self.error = exc
            try:
                from scheduler.request import RequestStatus

                self.engine.abort_all(RequestStatus.FINISHED_ERROR)  # free the blocks if the engine still can
            except Exception:  # noqa: BLE001 - best effort on an engine that already failed
                logger.debug("freeing the blocks of a failed engine failed too", exc_info=True)
            self._fail_all("error", GENERIC_ENGINE_ERROR)
