"""The engine loop in its own thread, and the asyncio client the server talks to.

The loop thread owns the ``LLMEngine``: only it calls ``add_request``/``abort``/``step``.
Callers hand it commands through a thread-safe queue and get outputs back on per-request
``asyncio.Queue``s, fed with ``call_soon_threadsafe`` once per step. The event loop therefore
never waits on a model step, and a step never waits on the event loop.

Failure contract: if a step raises, the engine is marked dead, every in-flight request gets a
final output with ``finish_reason="error"``, and later ``generate`` calls raise
``EngineDeadError`` at once; ``is_healthy`` turns False.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence

from engine.llm_engine import LLMEngine
from engine.openmp import release_openmp_threads
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from scheduler.request import RequestStatus

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Receives, in the loop thread, each step's token count and outputs (metrics, logging)."""

    def on_step(self, num_tokens: int, outputs: list[RequestOutput]) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: "EngineObserver | None" = None) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between callers and the loop thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.observer = observer  # called in the loop thread after each step (metrics)
        self.num_steps = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # The model was built on this thread; its OpenMP workers would halve the loop's speed.
            release_openmp_threads()
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still live are aborted."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # the loop is gone: persist the KV tier and stop its threads

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Accepted requests not yet running (queued commands included); read without locking the loop."""
        return max(0, self.num_in_flight - len(self.engine.scheduler.running))

    # ---- the client side ------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine would refuse (reads only immutable config)."""
        self.engine.validate_prompt(prompt_token_ids, params)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the iterator aborts the request."""
        if self.error is not None or self._stop.is_set():
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params, cache_salt, priority, time.monotonic()))
        if self.error is not None or self._stop.is_set():
            # The loop may have answered every stream it knew of just before this one registered.
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        finished = False
        try:
            while not finished:
                out: RequestOutput = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the loop thread ----------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                with self._lock:
                    listening = command.request_id in self._streams
                if not listening:  # cancelled before it reached the engine
                    continue
                try:
                    self.engine.add_request(command.prompt_token_ids, command.params, command.request_id,
                                            command.cache_salt, command.priority, command.arrival_time)
                except ValueError as exc:
                    self._deliver([RequestOutput(command.request_id, [], "", finished=True,
                                                 finish_reason="error", error=str(exc))])
            else:
                out = self.engine.abort(command.request_id)
                if out is not None:
                    self._deliver([out])
                    if self.observer is not None:
                        self.observer.on_step(0, [out])

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self.engine.housekeeping()  # pin expiry / unpins while idle
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                if not outputs and self.engine.last_step_tokens == 0:
                    # Everything left waits for a grammar to compile: do not spin on empty steps.
                    self._wake.wait(0.002)
                    self._wake.clear()
                self._deliver(outputs)
                if self.observer is not None:
                    self.observer.on_step(self.engine.last_step_tokens, outputs)
            self._finish_all(RequestStatus.FINISHED_ABORTED, None)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            logger.exception("engine loop failed")
            self.error = exc
            self._finish_all(RequestStatus.FINISHED_ERROR, f"engine failure: {type(exc).__name__}: {exc}")

    def _finish_all(self, status: RequestStatus, message: str | None) -> None:
        """Give every open stream a final output, whether or not its request reached the engine."""
        try:
            outputs = self.engine.abort_all(status, message)
        except Exception:  # noqa: BLE001 - the engine may be wrecked; still answer every stream
            outputs = []
        with self._lock:
            pending = set(self._streams) - {o.request_id for o in outputs}
        outputs += [RequestOutput(rid, [], "", finished=True, finish_reason=status.finish_reason, error=message)
                    for rid in pending]
        self._deliver(outputs)
        if self.observer is not None:
            self.observer.on_step(0, outputs)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
