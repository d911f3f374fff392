"""The one place where engine-core outputs become ``RequestOutput``s.

Per request it keeps the detokenizer (text deltas, stop strings) and the output token count.
Contract:
- ``process`` turns one step's ``EngineCoreOutput``s into ``RequestOutput``s, in order, and
  returns the ids of requests that a stop string finished here: the core still runs them, so
  the caller must abort them in the core (outputs the core sends for them later are dropped);
- a request's last ``RequestOutput`` has ``finished=True``; afterwards it is forgotten;
- a core failure message never reaches the output: ``error`` carries ``GENERIC_ENGINE_ERROR``,
  unless the core marked the error as the client's own (``EngineCoreOutput.error``: an invalid
  grammar), whose message is passed on.

Not thread-safe: its owner calls it from one thread at a time (the client holds a lock).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from engine.core.protocol import GENERIC_ENGINE_ERROR, EngineCoreOutput
from engine.core.detokenizer import IncrementalDetokenizer, token_pieces
from kvtypes.outputs import RequestOutput
from kvtypes.sampling_params import SamplingParams


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer | None
    num_prompt_tokens: int
    arrival_time: float
    num_output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        token_pieces(tokenizer)  # built here (0.2-0.5 s for a 49k vocabulary), not in the first request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float) -> None:
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
                 if self.tokenizer is not None else None)
        self._states[request_id] = _RequestState(detok, len(prompt_token_ids), arrival_time)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, outputs: Iterable[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # finished here already (stop string), or never added
                continue
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            detok = state.detokenizer
            taken = 0  # a stop string ends a speculative run of several tokens where it is found
            for token in out.new_token_ids:
                state.num_output_tokens += 1
                taken += 1
                if detok is not None and detok.add_token(token) is not None:
                    if finish_reason is None:
                        stopped.append(out.request_id)
                    finish_reason, stop_reason = "stop", detok.stopped_on
                    break
            finished = finish_reason is not None
            results.append(RequestOutput(
                request_id=out.request_id, new_token_ids=out.new_token_ids[:taken],
                text=detok.take_delta(finished) if detok is not None else "",
                finished=finished, finish_reason=finish_reason, stop_reason=stop_reason,
                num_prompt_tokens=state.num_prompt_tokens, num_output_tokens=state.num_output_tokens,
                num_cached_tokens=out.num_cached_tokens, num_cache_write_tokens=out.num_cache_write_tokens,
                num_evicted_tokens=out.num_evicted_tokens, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs,
                error=(out.error or GENERIC_ENGINE_ERROR) if finish_reason == "error" else None,
                arrival_time=state.arrival_time, first_scheduled_time=out.first_scheduled_time))
            if finished:
                del self._states[out.request_id]
        return results, stopped

    def finish(self, request_id: str, finish_reason: str, message: str | None = None) -> RequestOutput | None:
        """End a request here (its caller left: ``abort``); its final output, or None if it was not live."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        return RequestOutput(request_id=request_id, new_token_ids=[],
                             text=state.detokenizer.take_delta(True) if state.detokenizer is not None else "",
                             finished=True, finish_reason=finish_reason, num_prompt_tokens=state.num_prompt_tokens,
                             num_output_tokens=state.num_output_tokens, error=message,
                             arrival_time=state.arrival_time)

    def finish_all(self, finish_reason: str, message: str | None) -> list[RequestOutput]:
        """Final outputs for every request still known (the core is gone or stopping)."""
        return [out for rid in list(self._states) if (out := self.finish(rid, finish_reason, message)) is not None]
