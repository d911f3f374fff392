"""The engine core: the one loop that owns an ``LLMEngine`` (model, device, KV pool, scheduler) and steps it.

The same loop runs in its own process (``run_core_process``, the served default; see
``engine/core_client.py``) or in a thread of the caller (in-process mode, for tests and
benches). It takes commands (``AddRequest``, ``AbortRequests``, ``Shutdown``) between steps
and after every step sends ONE ``EngineCoreOutputs``: each request's new token ids and finish
state, plus one ``StepStats`` snapshot. It never detokenizes.

Failure contract: a request the engine refuses gets a final ``error`` output at once; a forward
pass that raises fails only the requests that raise when rerun alone (``LLMEngine.step``); any
other exception escapes ``run`` (the process exits non-zero and its client starts a new core).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, Sequence

from engine.core_protocol import (AbortRequests, AddRequest, CoreReady, EngineCoreOutput, EngineCoreOutputs,
                                  Shutdown)
from engine.llm_engine import EngineConfig, LLMEngine
from scheduler.request import RequestStatus

logger = logging.getLogger(__name__)

Command = AddRequest | AbortRequests | Shutdown
# How long an idle core blocks waiting for commands before it looks at its stop flag again.
IDLE_POLL_S = 0.5


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_steps = 0

    def handle(self, command: AddRequest | AbortRequests) -> list[EngineCoreOutput]:
        engine = self.engine
        if isinstance(command, AddRequest):
            try:
                engine.add_request(command.prompt_token_ids, command.params, command.request_id,
                                   command.cache_salt, command.priority, command.arrival_time)
            except ValueError:  # the client validates first, so this is a bug or a race: log it
                logger.exception("request %s refused by the engine", command.request_id)
                return [EngineCoreOutput(command.request_id, [], finish_reason="error")]
            return []
        return [out for rid in command.request_ids if (out := engine.abort(rid)) is not None]

    def step(self) -> EngineCoreOutputs:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.num_steps += 1
        return EngineCoreOutputs(outputs, self.engine.stats(time.perf_counter() - t0, self.engine.last_step_tokens))

    def run(self, receive: Callable[[float], Sequence[Command]], send: Callable[[EngineCoreOutputs], None],
            should_stop: Callable[[], bool] = lambda: False) -> None:
        """Loop until a ``Shutdown`` command (or ``should_stop``): then abort everything and return.

        ``receive(timeout)`` returns the commands that arrived (waiting up to ``timeout`` for the
        first one); ``send`` delivers one step's outputs.
        """
        engine = self.engine
        while True:
            commands = receive(0.0 if engine.has_unfinished() else IDLE_POLL_S)
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
                out = self.step()
                out.outputs = extra + out.outputs
                send(out)
            elif extra:
                send(EngineCoreOutputs(extra, engine.stats()))


class _FrontendGone(Exception):
    """The pipe to the frontend is closed: nobody is left to serve."""


def run_core_process(config: EngineConfig, commands, outputs) -> None:  # noqa: ANN001 - multiprocessing Connections
    """Entry point of the engine core process (started with the 'spawn' method).

    Sends ``CoreReady`` once the model is loaded, then runs the loop. Exit status: 0 after a
    ``Shutdown`` or when the frontend is gone, 1 when the engine failed.
    """
    # Ctrl-C reaches the whole process group: the frontend drains, then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    for noisy in ("transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        engine = LLMEngine(config)
    except Exception:  # noqa: BLE001
        logger.exception("the engine core failed to start")
        sys.exit(1)
    outputs.send(CoreReady(engine.info, engine.tokenizer, os.getpid()))

    def receive(timeout: float) -> list[Command]:
        try:
            if not commands.poll(timeout):
                return []
            received = [commands.recv()]
            while commands.poll(0):
                received.append(commands.recv())
            return received
        except (EOFError, OSError) as exc:
            raise _FrontendGone() from exc

    def send(message: EngineCoreOutputs) -> None:
        try:
            outputs.send(message)
        except OSError as exc:
            raise _FrontendGone() from exc

    core = EngineCore(engine)
    try:
        core.run(receive, send)
    except _FrontendGone:
        logger.info("the frontend is gone; the engine core exits")
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the client restarts the core
        logger.exception("the engine core failed")
        try:
            send(EngineCoreOutputs(engine.abort_all(RequestStatus.FINISHED_ERROR)))
        except BaseException:  # noqa: BLE001 - the engine may be wrecked; the client fails the rest
            pass
        sys.exit(1)
