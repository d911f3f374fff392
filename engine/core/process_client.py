"""``MPEngineClient``: the engine core in a child process of its own, the served default.

The core is started with 'spawn' (torch and fork do not mix) and talked to over two one-way
``multiprocessing`` pipes with pickle. A sender thread writes the commands, so a full pipe
never blocks the event loop. The step outputs are read by the server's event loop itself once
``bind_loop`` gave it one; before that, or without a loop, by the supervisor thread, which
also watches the process and restarts it. Exactly one of them reads at a time. The frontend
half (streams, detokenization, the observer) is ``engine.core.client._ClientBase``'s.

Faults: when the core process dies, every open stream gets a final ``error`` output at once
(the pipe's EOF), ``is_healthy`` is False while a new core loads, then True. After
``EngineCoreConfig.max_failures`` deaths within ``failure_window_s`` the client stops
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
from typing import Any, Callable

from engine.config import EngineCoreConfig
from engine.core.client import EngineObserver, _ClientBase
from engine.core.output_processor import OutputProcessor
from engine.log_format import check_log_format
from engine.core.protocol import (GENERIC_ENGINE_ERROR, AbortRequests, AddRequest, CoreReady, MessageReader,
                                  Shutdown, Unpin)

logger = logging.getLogger(__name__)
# Extra time a stopping core with a disk tier gets to write its pool out before it is killed.
DISK_FLUSH_GRACE_S = 60.0
# How often the supervisor looks for a newly bound (or closed) event loop to hand the pipe over.
HANDOVER_POLL_S = 0.1


class MPEngineClient(_ClientBase):
    """The core in a child process (see the module doc). ``start`` blocks until the model is loaded."""

    def __init__(self, config: Any, observer: EngineObserver | None = None,
                 on_fatal: Callable[[], None] | None = None, log_format: str = "text") -> None:
        super().__init__(observer)
        check_log_format(log_format)
        self.config = config  # EngineConfig, pickled to each core process
        self.log_format = log_format  # of the core process's log lines (engine.log_format)
        self.core_config: EngineCoreConfig = config.core
        self.on_fatal = on_fatal
        self.core_pid: int | None = None
        self.num_core_starts = 0
        self._healthy = False
        self._stopping = False
        self._failures: collections.deque[float] = collections.deque()
        self._proc: Any = None
        self._cmd_conn: Any = None
        self._out_reader: MessageReader | None = None  # the current core's output pipe, read by one side at a time
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
        proc = ctx.Process(target=run_core_process, args=(self.config, cmd_recv, out_send, self.log_format),
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
        self._proc, self._cmd_conn, self._out_reader = proc, cmd_send, MessageReader(out_recv)
        self.core_pid = ready.pid
        logger.info("engine core process started (pid %d)", ready.pid)
        return ready

    def _supervise(self) -> None:
        while True:
            self._read_until_eof(self._out_reader)
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

    def _read_until_eof(self, reader: MessageReader) -> None:
        """Process the outputs of one core until its pipe ends: in this thread until a loop is
        bound, then on that loop (see bind_loop), and back here if that loop closes."""
        while True:
            loop = self._loop
            if loop is None or loop.is_closed():
                try:
                    while self._loop is None or self._loop.is_closed():
                        if reader.poll(HANDOVER_POLL_S):
                            for message in reader.read():
                                self._on_outputs(message)
                except (EOFError, OSError):
                    return
                continue
            ended = threading.Event()
            try:
                loop.call_soon_threadsafe(self._attach_reader, loop, reader, ended)
            except RuntimeError:  # closed meanwhile: read here again
                continue
            while not ended.wait(HANDOVER_POLL_S):
                if loop.is_closed():  # its reader died with it; nothing was read after the last message
                    self.outputs_read_on_loop = False
                    break
            if ended.is_set():
                return

    def _attach_reader(self, loop: asyncio.AbstractEventLoop, reader: MessageReader, ended: threading.Event) -> None:
        def on_readable() -> None:  # called when the pipe is readable: one read, then back to the loop
            try:
                for message in reader.read():
                    self._on_outputs(message, loop)
            except (EOFError, OSError):
                loop.remove_reader(fd)
                self.outputs_read_on_loop = False
                ended.set()

        if reader.conn.closed:  # shutdown closed it already
            ended.set()
            return
        fd = reader.fd
        loop.add_reader(fd, on_readable)
        self.outputs_read_on_loop = True
        if reader.poll(0):  # what arrived during the hand-over
            on_readable()

    def _on_core_death(self) -> None:
        self._healthy = False
        proc = self._proc
        proc.join(1.0)
        logger.error("the engine core process (pid %s) died with exit code %s; failing %d in-flight requests",
                     self.core_pid, proc.exitcode, len(self._streams))
        self._out_reader.conn.close()
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
