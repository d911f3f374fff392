"""The engine core: the one loop that owns an ``LLMEngine`` (model, device, KV pool, scheduler) and steps it.

The same loop runs in its own process (``run_core_process``, the served default; see
``engine/core/client.py``) or in a thread of the caller (in-process mode, for tests and
benches). It takes commands (``AddRequest``, ``AbortRequests``, ``Unpin``, ``Shutdown``) between
steps and after every step sends ONE ``EngineCoreOutputs``: each request's new token ids and
finish state, plus one ``StepStats`` snapshot. It never detokenizes.

Pacing: while requests are live it steps back to back, except when a step ran no tokens (every
live request waits for its grammar to compile or for KV blocks from the disk tier): then it
waits up to ``STALLED_WAIT_S`` on the command pipe instead of spinning, and sends nothing
unless that step produced outputs. An idle core that receives a request first takes the ones
that follow it, until none has come for ``burst_gap_s`` (at most ``BURST_GAPS`` such gaps in
all), so that requests sent together prefill in one step (``EngineCoreConfig.burst_gap_ms``).
While idle it runs ``LLMEngine.housekeeping`` (pin expiry, requested unpins) between waits of
``IDLE_POLL_S`` and sends a stats-only message when pins or tier counters changed. On every
way out of ``run`` it calls ``LLMEngine.close`` (the disk tier gets the pool's cached blocks and
its writes finish).

Failure contract: a request the engine refuses gets a final ``error`` output at once; a forward
pass that raises fails only the requests that raise when rerun alone (``LLMEngine.step``); any
other exception escapes ``run`` (the process exits non-zero and its client starts a new core).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import time
from typing import Callable, Sequence

from engine.core.protocol import (AbortRequests, AddRequest, CoreReady, EngineCoreOutput, EngineCoreOutputs,
                                  Shutdown, Unpin, pipe_poller)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.log_format import JsonFormatter, format_root_handlers
from scheduler.request import RequestStatus

logger = logging.getLogger(__name__)

Command = AddRequest | AbortRequests | Unpin | Shutdown
# How long an idle core blocks waiting for commands before it looks at its stop flag, its pins
# and its tier counters again.
IDLE_POLL_S = 0.5
# How long a core whose last step ran no tokens waits for a command before stepping again
# (grammars compile in ~ms; tier loads are polled inside the step as well).
STALLED_WAIT_S = 0.002
# The longest an idle core collects a burst of requests before its first step: this many gaps.
BURST_GAPS = 8


class EngineCore:
    def __init__(self, engine: LLMEngine, burst_gap_s: float = 0.0) -> None:
        self.engine = engine
        self.num_steps = 0
        self.burst_gap_s = burst_gap_s

    def handle(self, command: AddRequest | AbortRequests | Unpin) -> list[EngineCoreOutput]:
        engine = self.engine
        if isinstance(command, Unpin):
            engine.unpin(command.block_hash)  # unknown hash: nothing to do (fire and forget)
            return []
        if isinstance(command, AddRequest):
            try:
                engine.add_request(command.prompt_token_ids, command.params, command.request_id,
                                   command.cache_salt, command.priority, command.arrival_time,
                                   command.tenant)
            except ValueError:  # the client validates first, so this is a bug or a race: log it
                logger.exception("request %s refused by the engine", command.request_id)
                return [EngineCoreOutput(command.request_id, [], finish_reason="error")]
            return []
        return [out for rid in command.request_ids if (out := engine.abort(rid, command.stopped)) is not None]

    def run(self, receive: Callable[[float], Sequence[Command]], send: Callable[[EngineCoreOutputs], None],
            should_stop: Callable[[], bool] = lambda: False) -> None:
        """Loop until a ``Shutdown`` command (or ``should_stop``): then abort everything and return.

        ``receive(timeout)`` returns the commands that arrived (waiting up to ``timeout`` for the
        first one); ``send`` delivers one step's outputs. ``LLMEngine.close`` runs on every exit.
        """
        try:
            self._loop(receive, send, should_stop)
        finally:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - the engine may be wrecked already; the exit goes on
                logger.exception("closing the engine failed")

    def _loop(self, receive: Callable[[float], Sequence[Command]], send: Callable[[EngineCoreOutputs], None],
              should_stop: Callable[[], bool]) -> None:
        engine = self.engine
        stalled = False  # the previous step ran no tokens
        while True:
            busy = engine.has_unfinished()
            commands = receive((STALLED_WAIT_S if stalled else 0.0) if busy else IDLE_POLL_S)
            if not busy and self.burst_gap_s > 0 and any(isinstance(c, AddRequest) for c in commands):
                commands = self._rest_of_burst(commands, receive)
            extra: list[EngineCoreOutput] = []
            for command in commands:
                if isinstance(command, Shutdown):
                    should_stop = lambda: True  # noqa: E731
                    break
                extra += self.handle(command)
            if should_stop():
                send(EngineCoreOutputs(extra + engine.abort_all(RequestStatus.FINISHED_ABORTED), engine.stats()))
                return
            if engine.has_unfinished():
                t0 = time.perf_counter()
                outputs = extra + engine.step()
                self.num_steps += 1
                stalled = engine.last_step_tokens == 0
                if outputs or not stalled:
                    send(EngineCoreOutputs(outputs, engine.stats(time.perf_counter() - t0, engine.last_step_tokens)))
                continue
            stalled = False
            engine.housekeeping()  # pin expiry and requested unpins while idle
            if extra or engine.stats_changed():
                send(EngineCoreOutputs(extra, engine.stats()))

    def _rest_of_burst(self, commands: Sequence[Command],
                       receive: Callable[[float], Sequence[Command]]) -> list[Command]:
        """``commands`` and those that follow them within ``burst_gap_s`` of each other, for at
        most ``BURST_GAPS`` gaps: while the core waits here the frontend has the CPUs to itself.
        (Measured: 4 concurrent 50-token requests to the 1B Q4_K_M on 2 cores reached the core
        ~7 ms apart, the frontend sharing the cores with the first one's prefill step; stepped at
        once, three of them waited for that whole step, TTFT p50 ~620 ms; with a 4 ms gap all four
        prefilled together, ~450 ms.)"""
        commands = list(commands)
        end = time.monotonic() + BURST_GAPS * self.burst_gap_s
        while (left := end - time.monotonic()) > 0 and (more := receive(min(self.burst_gap_s, left))):
            commands += more
        return commands


def _rank_lost(rank: int, exitcode: int | None) -> None:
    """A tensor-parallel rank died: the group is broken for good, so this core exits at once
    (its client fails the requests in flight and starts a new core, which spawns a new group)."""
    logger.critical("tensor-parallel rank %d died (exit code %s); the engine core exits", rank, exitcode)
    logging.shutdown()
    os._exit(1)


class _FrontendGone(Exception):
    """The pipe to the frontend is closed: nobody is left to serve."""


def run_core_process(config: EngineConfig, commands, outputs,  # noqa: ANN001 - multiprocessing Connections
                     log_format: str = "text") -> None:
    """Entry point of the engine core process (started with the 'spawn' method); its log lines
    are ``log_format`` (engine.log_format), like the server's.

    Sends ``CoreReady`` once the model is loaded, then runs the loop. Exit status: 0 after a
    ``Shutdown`` or when the frontend is gone, 1 when the engine failed.
    """
    # Ctrl-C reaches the whole process group: the frontend drains, then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The client starts the core daemonic (the frontend's exit ends it); with tensor parallelism
    # the core spawns the other ranks, which multiprocessing forbids a daemonic process.
    multiprocessing.current_process().daemon = False
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    if log_format == "json":
        format_root_handlers(JsonFormatter(process="core"))
    for noisy in ("transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        engine = LLMEngine(config)
    except Exception:  # noqa: BLE001
        logger.exception("the engine core failed to start")
        sys.exit(1)
    engine.watch_ranks(_rank_lost)
    # What loading made (the model, torch, transformers: ~10^6 objects) lives as long as the
    # process: out of the collector's sight, a full collection no longer walks it every few
    # hundred steps (~2% of a 16-stream decode step on 2 cores, perf).
    gc.collect()
    gc.freeze()
    outputs.send(CoreReady(engine.info, engine.tokenizer, os.getpid()))

    readable = pipe_poller(commands)

    def receive(timeout: float) -> list[Command]:
        try:
            if not readable(timeout):
                return []
            received = [commands.recv()]
            while readable(0):
                received.append(commands.recv())
            return received
        except (EOFError, OSError) as exc:
            raise _FrontendGone() from exc

    def send(message: EngineCoreOutputs) -> None:
        try:
            outputs.send(message)
        except OSError as exc:
            raise _FrontendGone() from exc

    core = EngineCore(engine, config.core.burst_gap_ms / 1e3)
    try:
        core.run(receive, send)
    except _FrontendGone:
        logger.info("the frontend is gone; the engine core exits")
        # ``run`` closed the engine (disk tier flushed, other ranks stopped); an orphan skips the
        # interpreter's teardown (seconds of destructors on a loaded machine).
        logging.shutdown()
        os._exit(0)
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the client restarts the core
        logger.exception("the engine core failed")
        try:
            send(EngineCoreOutputs(engine.abort_all(RequestStatus.FINISHED_ERROR)))
        except BaseException:  # noqa: BLE001 - the engine may be wrecked; the client fails the rest
            pass
        sys.exit(1)
