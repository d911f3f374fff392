"""Constrained decoding with llguidance: spec -> grammar -> one matcher per request -> bitmask.

Why llguidance (and not xgrammar): its wheel has no dependencies at all (xgrammar's pulls
triton and apache-tvm-ffi), grammars are compiled lazily in microseconds to milliseconds
(with the GIL released), and it fills a token bitmask on the CPU, which is where this engine
samples. vLLM ships it as its ``guidance`` backend.

Threading contract: compilation runs on one background thread (``GrammarCompiler``), never
in the engine's step, at a lower priority than the engine's threads (``COMPILE_NICENESS``);
the engine thread alone touches a request's matcher (``RequestGrammar``) once its compile
future is done. A grammar that fails to compile fails its request only.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from engine.sampling.json_bounds import JSON_OBJECT_SCHEMA, bounded
from kvtypes.structured_spec import JSON_LAYOUT, StructuredOutputSpec

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


# How much nicer than the engine the compile thread runs. Where the engine's threads fill the
# cores (2 cores, 2 threads), a compile took a core from one of them mid-step and the other
# spun at the next barrier: 8 fresh 40-property schemas (~3.5 ms of compile each) stretched the
# plain 16-row decode steps from ~15 to 25-65 ms (python -m bench structured). At +10 the
# compile gets ~10% of a busy core, so its cost is spread thin over more steps (the new-schema
# requests wait longer for their first token); on cores the engine leaves idle it changes nothing.
COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """Run the calling thread ``COMPILE_NICENESS`` nicer than it is (Linux: per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS))
    except (AttributeError, OSError):  # no setpriority here, or not allowed: run at the engine's priority
        logger.debug("the grammar compile thread keeps the engine's priority")


class GrammarError(ValueError):
    """The spec cannot be turned into a grammar (bad schema, regex or grammar text)."""


def grammar_definition(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar text for ``spec``; raises GrammarError when it is malformed.

    Needs no tokenizer, so the frontend can call it (with :func:`validate_spec`) to answer 400.
    """
    import llguidance

    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object":
            schema: Any = JSON_OBJECT_SCHEMA
        else:
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if schema is True or schema == {}:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        schema = bounded(schema)  # so that the value ends (json_bounds says how)
        schema["x-guidance"] = {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}
        return json.dumps({"grammars": [{"json_schema": schema}]})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError:
            choices = None
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise GrammarError("choice must be a non-empty list of strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec.value)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def validate_spec(spec: StructuredOutputSpec) -> None:
    """Raise GrammarError (message meant for the client) if ``spec`` cannot compile."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_definition(spec))
    if error:
        raise GrammarError(error.splitlines()[0] if error else "invalid grammar")


class GrammarCompiler:
    """Compiles specs to template matchers on one background thread, cached by spec hash.

    The llguidance view of the tokenizer (~1.5 s to build for a 49k vocabulary) is built on
    that thread too, as soon as the compiler exists. ``submit`` is cheap and thread-safe; a cached spec costs a
    dictionary lookup. The cache is per compiler, i.e. per tokenizer.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, max_cached: int = 256) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()
        self._cache: dict[str, Future] = {}
        self._max_cached = max_cached
        self._ll_tokenizer: Any = None
        self.num_compiled = 0
        # Built now, in the background, so the first structured request does not wait for it
        # (and its ~1.5 s of Python does not compete with traffic for the GIL later); at the
        # engine's priority, as at ~10% of a busy core it would take ~15 s. Compiles come after.
        self._executor.submit(self._tokenizer)
        self._executor.submit(_lower_priority)

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_definition(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().splitlines()[0])
        self.num_compiled += 1
        return matcher

    def submit(self, spec: StructuredOutputSpec) -> Future:
        """A future of a fresh template matcher for ``spec`` (never consume from it: copy it)."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is None or (future.done() and future.exception() is not None):
                if len(self._cache) >= self._max_cached:
                    self._cache.pop(next(iter(self._cache)))
                future = self._cache[spec.key] = self._executor.submit(self._compile, spec)
            return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state; only the engine thread calls anything but ``ready``."""

    def __init__(self, future: Future) -> None:
        self._future = future
        self._matcher: Any = None
        self._resolved = False
        self.error: str | None = None

    def compiled(self) -> bool:
        """Compilation finished (successfully or not); ``resolve`` may be called."""
        return self._future.done()

    def ready(self) -> bool:
        """Resolved by the engine thread: the request may be scheduled (the scheduler asks)."""
        return self._resolved

    def resolve(self) -> bool:
        """After ``compiled``: build this request's matcher; False (and ``error`` set) on failure."""
        if not self._resolved:
            try:
                self._matcher = self._future.result().deep_copy()
            except Exception as exc:  # noqa: BLE001 - a bad grammar fails its request, never the engine
                self.error = str(exc) or type(exc).__name__
            self._resolved = True
        return self._matcher is not None

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-next-token bitmask (int32 words, bit i of word w = token 32w+i)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False if the grammar rejects it (then ``error`` is set)."""
        if self._matcher.consume_token(token_id):
            return True
        self.error = (self._matcher.get_error() or "token rejected by the grammar").splitlines()[0]
        return False

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS would follow)."""
        return self._matcher is not None and self._matcher.is_stopped()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, t]`` to -inf wherever bit ``t`` of ``bitmask[r]`` is 0, in place.

    ``logits`` is ``[rows, vocab]``; ``bitmask`` is ``[rows, ceil(vocab/32)]`` int32.
    """
    rows, vocab = logits.shape
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # Word w's bit i is byte 4w + i // 8, bit i % 8 in memory: numpy's little-endian unpack
        # yields token order directly, ~50x faster than shifting 32 bit planes in torch.
        words = bitmask.contiguous().numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(words, axis=1, count=vocab, bitorder="little"))
    else:
        allowed = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).view(rows, -1)[:, :vocab]
    # Arithmetic, not masked_fill_: on a CPU thread masked_fill_/where over a [16, 49k] bool mask
    # cost ~5-15 ms, an add ~1 ms. Banned tokens get -max twice, which overflows to exactly -inf;
    # allowed ones get 0.
    huge = torch.finfo(logits.dtype).max
    logits.add_(allowed.to(device=logits.device, dtype=logits.dtype).sub_(1.0).mul_(huge), alpha=2.0)
