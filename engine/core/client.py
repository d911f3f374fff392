"""The frontend's side of the engine core: one ``EngineClient`` interface, two implementations.

- ``MPEngineClient`` (the served default) runs the core in a process of its own (started with
  'spawn': torch and fork do not mix) and talks to it over two one-way
  ``multiprocessing`` pipes with pickle (chosen by measurement: ``python -m bench.probes.ipc_transport``,
  numbers in docs/architecture.md). A sender thread writes the commands, so a full pipe never
  blocks the event loop. The step outputs are read by the server's event loop itself once
  ``bind_loop`` gave it one (a reader on the pipe: no thread hop and no self-pipe wake-up per
  step, the frontend's main per-token cost); before that, or without a loop, by the supervisor
  thread, which also watches the process and restarts it. Exactly one of them reads at a time.
- ``InprocEngineClient`` runs the same core loop (``EngineCore.run``) in a thread of this
  process (tests, benches).

Both share the frontend half (``_ClientBase``): ``generate`` registers a stream and the request
in the ``OutputProcessor`` (detokenization, stop strings: the one place), each step's outputs
are processed in the receiving thread and handed to the streams' event loops with one
``call_soon_threadsafe`` per loop, requests a stop string finished are aborted in the core, and
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
import multiprocessing
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from engine.config import EngineCoreConfig
from engine.core.protocol import (GENERIC_ENGINE_ERROR, AbortRequests, AddRequest, CoreReady, EngineCoreOutputs,
                                  EngineInfo, Shutdown, StepStats, Unpin, pipe_poller)
from engine.core.output_processor import OutputProcessor
from kvtypes.outputs import RequestOutput
from kvtypes.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Extra time a stopping core with a disk tier gets to write its pool out before it is killed.
DISK_FLUSH_GRACE_S = 60.0
# How often the supervisor looks for a newly bound (or closed) event loop to hand the pipe over.
HANDOVER_POLL_S = 0.1


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
                 cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]: ...
    def unpin(self, block_hash: str) -> None: ...


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class _ClientBase:
    """Streams, output processing and observer calls shared by both clients (see the module doc)."""

    info: EngineInfo
    tokenizer: Any

    def __init__(self, observer: EngineObserver | None = None) -> None:
        self.observer = observer
        self.fatal = False
        self._streams: dict[str, _Stream] = {}
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
                       cache_salt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the iterator aborts the request."""
        self.validate(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        add = AddRequest(request_id, list(prompt_token_ids), params, cache_salt, priority, time.monotonic())
        with self._lock:
            if not self.is_healthy:
                raise EngineDeadError("the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._processor.add_request(request_id, add.prompt_token_ids, params, add.arrival_time)
            epoch = self._epoch
        self._send(add, epoch)
        finished = False
        try:
            while not finished:
                out: RequestOutput = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                aborted = self._processor.finish(request_id, "abort")
            if not finished:
                self._send(AbortRequests([request_id]), epoch)
            if aborted is not None:  # the caller left: metrics count it here (the core's answer is dropped)
                self._observe(None, [aborted])

    def abort(self, request_id: str) -> None:
        self._send(AbortRequests([request_id]), self._epoch)

    def unpin(self, block_hash: str) -> None:
        """Ask the core to release a pin (fire and forget; the next snapshot shows the result)."""
        self._send(Unpin(block_hash), self._epoch)

    # ---- the receiving thread ------------------------------------------------------------------
    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        with self._lock:
            outputs, stopped = self._processor.process(message.outputs)
            epoch = self._epoch
        if stopped:
            self._send(AbortRequests(stopped, stopped=True), epoch)
        if message.stats is not None:
            self._stats = message.stats
            if message.stats.num_batched_tokens:
                self.num_steps += 1
        self._deliver(outputs)
        self._observe(message.stats, outputs)

    def _fail_all(self, finish_reason: str, message: str | None, reset_stats: bool = False) -> None:
        """Give every open stream a final output; with ``reset_stats``, a dead core's gauges read zero."""
        with self._lock:
            self._epoch += 1
            outputs = self._processor.finish_all(finish_reason, message) if self._processor is not None else []
        stats = None
        if reset_stats:
            stats = self._stats = StepStats(kv_num_blocks=self.info.num_blocks, kv_block_size=self.info.block_size)
        self._deliver(outputs)
        self._observe(stats, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        here = _running_loop()
        for loop, items in by_loop.items():
            if loop is here:  # read on that loop (bind_loop): hand over directly
                _put_all(items)
                continue
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _observe(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        if self.observer is not None and (stats is not None or outputs):
            try:
                self.observer.on_step(stats, outputs)
            except Exception:  # noqa: BLE001 - an observer bug must never stop the outputs
                logger.exception("engine observer failed")

    def _send(self, command: AddRequest | AbortRequests | Unpin | Shutdown, epoch: int) -> None:
        raise NotImplementedError


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


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
            EngineCore(self.engine).run(self._receive, self._on_outputs, self._stop.is_set)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting client
            logger.exception("engine loop failed")
            self.error = exc
            try:
                from scheduler.request import RequestStatus

                self.engine.abort_all(RequestStatus.FINISHED_ERROR)  # free the blocks if the engine still can
            except Exception:  # noqa: BLE001
                pass
            self._fail_all("error", GENERIC_ENGINE_ERROR)


# ==== separate process =============================================================================
class MPEngineClient(_ClientBase):
    """The core in a child process (see the module doc). ``start`` blocks until the model is loaded."""

    def __init__(self, config: Any, observer: EngineObserver | None = None,
                 on_fatal: Callable[[], None] | None = None) -> None:
        super().__init__(observer)
        self.config = config  # EngineConfig, pickled to each core process
        self.core_config: EngineCoreConfig = config.core
        self.on_fatal = on_fatal
        self.core_pid: int | None = None
        self.num_core_starts = 0
        self._healthy = False
        self._stopping = False
        self._failures: collections.deque[float] = collections.deque()
        self._proc: Any = None
        self._cmd_conn: Any = None
        self._out_conn: Any = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._supervisor: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # reads the outputs once bound (bind_loop)
        self.outputs_read_on_loop = False  # whether a bound loop reads the outputs now (else the supervisor)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._supervisor is not None:
            return
        ready = self._launch()
        self.info, self.tokenizer = ready.info, ready.tokenizer
        self._processor = OutputProcessor(self.tokenizer)
        self._healthy = True
        self._sender = threading.Thread(target=self._send_forever, name="kvserve-core-sender", daemon=True)
        self._sender.start()
        self._supervisor = threading.Thread(target=self._supervise, name="kvserve-core-supervisor", daemon=True)
        self._supervisor.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight (the streams end with ``abort``), stop the core, join the threads."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put((self._epoch, Shutdown()))
        self._outbox.put(None)
        if self._supervisor is not None:
            self._supervisor.join(timeout)
        proc = self._proc
        if proc is not None:
            # With a disk tier the core writes its cached blocks out before exiting (LLMEngine.close).
            info = getattr(self, "info", None)
            proc.join(max(1.0, timeout / 2) + (DISK_FLUSH_GRACE_S if info is not None and info.has_disk_tier else 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._healthy = False
        self._fail_all("abort", None)

    @property
    def is_healthy(self) -> bool:
        return self._healthy and not self._stopping

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have ``loop`` read the core's outputs from now on (the server's event loop, at startup).

        The supervisor hands the pipe over between two messages, so outputs keep their order. If
        the loop closes while it reads, the supervisor reads again. ``shutdown`` must then not be
        called on that loop's thread (the server calls it in a worker thread): the loop has to go
        on running to read the core's last outputs."""
        self._loop = loop

    # ---- the core process ------------------------------------------------------------------------
    def _launch(self) -> CoreReady:
        from engine.core.loop import run_core_process

        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        # Daemonic: our exit ends it. With tensor parallelism the core clears its own flag to spawn
        # its ranks (run_core_process); they die with it.
        proc = ctx.Process(target=run_core_process, args=(self.config, cmd_recv, out_send),
                           name="kvserve-engine-core", daemon=True)
        proc.start()
        # Close our copies of the child's ends: its death then shows here as EOF at once.
        cmd_recv.close()
        out_send.close()
        self.num_core_starts += 1
        try:
            if not out_recv.poll(self.core_config.startup_timeout_s):
                raise RuntimeError(f"the engine core did not start within {self.core_config.startup_timeout_s:.0f}s")
            ready = out_recv.recv()
        except (EOFError, OSError, RuntimeError) as exc:
            if isinstance(exc, EOFError):  # it is exiting on its own: report its status, not our kill's
                proc.join(5)
            proc.kill()
            proc.join(5)
            out_recv.close()
            cmd_send.close()
            raise RuntimeError(f"the engine core failed to start (exit code {proc.exitcode}); see the log") from exc
        if not isinstance(ready, CoreReady):
            raise RuntimeError(f"unexpected first message from the engine core: {type(ready).__name__}")
        self._proc, self._cmd_conn, self._out_conn = proc, cmd_send, out_recv
        self.core_pid = ready.pid
        logger.info("engine core process started (pid %d)", ready.pid)
        return ready

    def _supervise(self) -> None:
        while True:
            self._read_until_eof(self._out_conn)
            if self._stopping:
                return
            self._on_core_death()
            while not self._stopping and not self.fatal:
                try:
                    self._launch()
                    self._healthy = True
                    logger.info("engine core restarted; serving again")
                    break
                except Exception:  # noqa: BLE001 - a core that cannot start counts as a failure
                    logger.exception("restarting the engine core failed")
                    self._record_failure()
            if self.fatal or self._stopping:
                return

    def _read_until_eof(self, conn: Any) -> None:
        """Process the outputs of one core until its pipe ends: in this thread until a loop is
        bound, then on that loop (see bind_loop), and back here if that loop closes."""
        while True:
            loop = self._loop
            if loop is None or loop.is_closed():
                try:
                    while self._loop is None or self._loop.is_closed():
                        if conn.poll(HANDOVER_POLL_S):
                            self._on_outputs(conn.recv())
                except (EOFError, OSError):
                    return
                continue
            ended = threading.Event()
            try:
                loop.call_soon_threadsafe(self._attach_reader, loop, conn, ended)
            except RuntimeError:  # closed meanwhile: read here again
                continue
            while not ended.wait(HANDOVER_POLL_S):
                if loop.is_closed():  # its reader died with it; nothing was read after the last message
                    self.outputs_read_on_loop = False
                    break
            if ended.is_set():
                return

    def _attach_reader(self, loop: asyncio.AbstractEventLoop, conn: Any, ended: threading.Event) -> None:
        def on_readable() -> None:
            try:
                while readable(0):  # True at EOF as well: recv raises then
                    self._on_outputs(conn.recv())
            except (EOFError, OSError):
                loop.remove_reader(fd)
                self.outputs_read_on_loop = False
                ended.set()

        try:
            fd = conn.fileno()
        except OSError:  # closed already (shutdown)
            ended.set()
            return
        readable = pipe_poller(conn)
        loop.add_reader(fd, on_readable)
        self.outputs_read_on_loop = True
        on_readable()  # what arrived during the hand-over

    def _on_core_death(self) -> None:
        self._healthy = False
        proc = self._proc
        proc.join(1.0)
        logger.error("the engine core process (pid %s) died with exit code %s; failing %d in-flight requests",
                     self.core_pid, proc.exitcode, len(self._streams))
        self._out_conn.close()
        self._cmd_conn.close()
        self._fail_all("error", GENERIC_ENGINE_ERROR, reset_stats=True)
        self._record_failure()

    def _record_failure(self) -> None:
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.core_config.failure_window_s:
            self._failures.popleft()
        if len(self._failures) >= self.core_config.max_failures and not self.fatal:
            logger.critical("the engine core failed %d times within %.0fs: giving up (the server exits non-zero)",
                            len(self._failures), self.core_config.failure_window_s)
            self.fatal = True
            if self.on_fatal is not None:
                self.on_fatal()

    # ---- commands ------------------------------------------------------------------------------
    def _send(self, command: AddRequest | AbortRequests | Unpin | Shutdown, epoch: int) -> None:
        self._outbox.put((epoch, command))

    def _send_forever(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            epoch, command = item
            if epoch != self._epoch and not isinstance(command, Shutdown):
                continue  # meant for a core that died: its requests were failed already
            try:
                self._cmd_conn.send(command)
            except (OSError, ValueError):  # the core is gone (or its pipe closed): the supervisor acts
                pass
