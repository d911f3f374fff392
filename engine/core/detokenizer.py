"""Incremental detokenization with stop strings.

Text is released only when it is final: a token sequence that decodes to an incomplete
UTF-8 character (``\\ufffd`` at the end) waits for the next token, and the last
``len(longest stop string) - 1`` characters are held back until it is clear they do not
start a stop string. So a stream never splits a character and never emits stop text, and
the concatenated deltas equal the final text.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

# Tokens of the prompt's tail used as decoding context, so the first output token's
# leading space (SentencePiece) or byte pieces decode as they would mid-sequence.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """One request's text: ``add_token`` per output token, ``take_delta`` for what may be sent.

    Each token decodes the window of ids since the last release twice (with and without the
    pending tokens) and releases the difference once it ends in a whole character. Where the
    tokenizer is byte-level (``token_pieces``) and nothing is pending, a token whose bytes are
    whole UTF-8 characters is its own text, with no decode: its first byte is no continuation
    byte, so it ends whatever sequence the window's bytes left open (replaced alike either way)
    and the two decodes would differ by exactly its text."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decode = _raw_decoder(tokenizer, skip_special_tokens)  # ids -> text
        self._pieces = token_pieces(tokenizer)
        self.stop = [s for s in stop if s]
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._taken: list[str] = []  # the released text that take_delta returned, in order
        self._tail = ""  # the released text it has not returned yet (truncated at a stop string)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stopped_on: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any (then text ends before it)."""
        if self.stopped_on is not None:
            return self.stopped_on
        ids = self._ids
        pending = self._read_offset < len(ids)
        ids.append(token_id)
        pieces = self._pieces
        if not pending and pieces is not None and 0 <= token_id < len(pieces) and (piece := pieces[token_id]):
            return self._release(piece)
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return self._release(full[len(prefix):])

    @property
    def text(self) -> str:
        """The final output text so far (truncated at a stop string once found)."""
        return "".join(self._taken) + self._tail

    def _release(self, text: str) -> str | None:
        """``text`` joins the output and every id so far is released; the stop string it completed, if any."""
        # a stop string may start in the held-back characters, which take_delta leaves in _tail;
        # only _tail grows here, so a long output costs no copy of its whole text per token
        search_from = max(0, len(self._tail) - self._holdback)
        self._tail += text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for stop in self.stop:
            index = self._tail.find(stop, search_from)
            if index != -1:
                self._tail = self._tail[:index]
                self.stopped_on = stop
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet taken, but the last ``holdback`` characters (a stop string may start
        there); everything once the request is finished or stopped."""
        tail = self._tail
        end = len(tail) if finished or self.stopped_on else max(0, len(tail) - self._holdback)
        if not end:
            return ""
        delta, self._tail = tail[:end], tail[end:]
        self._taken.append(delta)
        return delta


def _raw_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` as one call: a transformers fast
    tokenizer that cleans up no spaces decodes with its ``tokenizers`` backend alone, which is
    what its ``decode`` returns then, without the argument handling around it (two decodes a
    streamed token: 3.4 -> 1.3 us each, warm). Where that backend decodes by the byte-level
    alphabet alone (GPT-2's, SmolLM2's, Llama 3's), the ids' bytes are joined in Python from a
    table (``byte_table``) and decoded as the backend does, with no call into it; an added or
    special token, or an id past the vocabulary, takes the backend's own rules."""
    backend = _backend(tokenizer)
    if backend is None:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    table = byte_table(backend)
    if table is None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode(ids: Sequence[int]) -> str:
        try:
            return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        except (TypeError, IndexError):  # None: an added token
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return decode


def _backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers`` backend whose decode is the tokenizer's own (a fast tokenizer that
    cleans up no spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend


# per backend, built once: (each id's bytes, each id's whole text) or (None, None)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(backend: Any) -> list[bytes | None] | None:
    """Each id's bytes (None for an added token), where ``backend`` (a ``tokenizers.Tokenizer``)
    decodes by the ``ByteLevel`` decoder alone: its text is then the ids' bytes, mapped back from
    the byte-level alphabet, as UTF-8 with invalid sequences replaced (U+FFFD). None for any
    other decoder, or a token outside the alphabet."""
    return _tables(backend)[0]


def token_pieces(tokenizer: Any) -> list[str | None] | None:
    """Each id's text where its bytes (``byte_table``) are whole UTF-8 characters on their own,
    neither empty nor ending in U+FFFD (None otherwise, and for added tokens); None where the
    tokenizer does not decode from a byte table."""
    backend = _backend(tokenizer)
    return None if backend is None else _tables(backend)[1]


def _tables(backend: Any) -> tuple[list[bytes | None] | None, list[str | None] | None]:
    if backend not in _TABLES:
        table = None
        if type(backend.decoder).__name__ == "ByteLevel":
            to_byte = {c: b for b, c in _byte_alphabet().items()}
            vocab = backend.get_vocab(with_added_tokens=True)
            added = set(backend.get_added_tokens_decoder())
            table = [None] * (max(vocab.values()) + 1)
            for token, i in vocab.items():
                if i in added:
                    continue
                if any(c not in to_byte for c in token):
                    table = None
                    break
                table[i] = bytes(to_byte[c] for c in token)
        _TABLES[backend] = (table, None if table is None else [_whole_text(raw) for raw in table])
    return _TABLES[backend]


def _whole_text(raw: bytes | None) -> str | None:
    if not raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if text.endswith("\ufffd") else text


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte b -> the printable character that stands for it (the
    printable Latin-1 bytes stand for themselves, the others for 256 + their order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet
