"""Incremental detokenization on the default model's tokenizer: the streamed deltas join into
exactly ``tokenizer.decode`` of the output, characters split across byte tokens wait for their
last byte, stop strings are never streamed, and the ``tokenizers`` backend decode it takes for
speed gives what transformers' ``decode`` gives at every step."""
from __future__ import annotations

import random

import pytest

from engine.core.detokenizer import IncrementalDetokenizer

TEXT = "Paris — café, naïve, 日本語, emoji 🙂🚀 and code:\ndef f(x):\n    return x ** 2\n"


@pytest.fixture(scope="module")
def tokenizer(default_engine):
    return default_engine.tokenizer


def _stream(tokenizer, prompt: list[int], output: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    for token in output:
        stopped = detok.add_token(token) is not None
        deltas.append(detok.take_delta(stopped))
        if stopped:
            break
    else:
        deltas.append(detok.take_delta(True))
    return deltas, detok


def test_deltas_join_into_the_decoded_output_and_never_split_a_character(tokenizer):
    rng = random.Random(0)
    prompt = tokenizer(TEXT)["input_ids"]
    output = tokenizer(TEXT * 2)["input_ids"] + [rng.randrange(len(tokenizer)) for _ in range(200)]
    deltas, _ = _stream(tokenizer, prompt, output)
    assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=True)
    assert not any(d.endswith("\ufffd") for d in deltas[:len(tokenizer(TEXT * 2)["input_ids"])])
    assert any("🙂" in d for d in deltas)  # a 4-byte character split across tokens arrives whole


@pytest.mark.parametrize("stop", ["return", "turn x *"])  # in one token; across three
def test_a_stop_string_is_never_streamed(tokenizer, stop):
    output = tokenizer(TEXT)["input_ids"]
    deltas, detok = _stream(tokenizer, [1, 2, 3], output, stop=[stop])
    assert detok.stopped_on == stop
    assert "".join(deltas) == detok.text == TEXT[:TEXT.index(stop)]
    assert all(stop[:2] not in d for d in deltas)


@pytest.mark.parametrize("cut_prompt", [False, True], ids=["prompt", "prompt-ending-mid-character"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_equals_transformers_decode_at_every_step(tokenizer, skip_special_tokens, cut_prompt,
                                                                 monkeypatch):
    """The fast detokenizer (byte table, and whole pieces without a decode) against two
    transformers decodes a token, over text, random ids (cut characters, stray bytes, pending
    tokens) and the special tokens."""
    assert not tokenizer.clean_up_tokenization_spaces  # so the backend's decode is taken
    decode = tokenizer.decode
    rng = random.Random(1)
    output = (tokenizer(TEXT)["input_ids"] + [rng.randrange(len(tokenizer)) for _ in range(300)]
              + list(tokenizer.all_special_ids))
    prompt = output[:5] + (tokenizer("🙂")["input_ids"][:1] if cut_prompt else [])
    fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    wrapped = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    wrapped._decode = lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    wrapped._pieces, wrapped._whole = None, False  # two decodes a token, always
    monkeypatch.setattr(tokenizer, "decode", None)  # the fast one must not call it
    for token in output[5:]:
        fast.add_token(token), wrapped.add_token(token)
        assert fast.take_delta(False) == wrapped.take_delta(False)
    assert fast.text == wrapped.text


def test_whole_pieces_take_no_decode(tokenizer):
    """A token whose bytes are whole characters, with nothing pending, is its own text; a
    character cut across tokens waits for its end and is decoded."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Hello")["input_ids"])
    calls = []
    decode = detok._decode
    detok._decode = lambda ids: calls.append(list(ids)) or decode(ids)
    for token in tokenizer(" world, and more text")["input_ids"]:
        detok.add_token(token)
    assert detok.text == " world, and more text" and calls == []
    for token in tokenizer("🙂")["input_ids"]:  # its four bytes in two tokens
        detok.add_token(token)
    assert detok.text.endswith("🙂") and calls


class _CountingBackend:
    """The default tokenizer's backend, counting its decode calls."""

    def __init__(self, backend) -> None:
        self.backend, self.decoder, self.calls = backend, backend.decoder, 0

    def decode(self, ids, skip_special_tokens):
        self.calls += 1
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self, with_added_tokens):
        return self.backend.get_vocab(with_added_tokens=with_added_tokens)

    def get_added_tokens_decoder(self):
        return self.backend.get_added_tokens_decoder()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_byte_table_decodes_as_the_backend_without_calling_it(tokenizer, skip_special_tokens):
    """A byte-level tokenizer's ids decode from the table: the same text as the backend's decode
    (invalid and split UTF-8 sequences replaced alike), with no call into it; an added or special
    token takes the backend."""
    from types import SimpleNamespace

    from engine.core.detokenizer import _raw_decoder

    counting = _CountingBackend(tokenizer.backend_tokenizer)
    decode = _raw_decoder(SimpleNamespace(backend_tokenizer=counting, clean_up_tokenization_spaces=False),
                          skip_special_tokens)
    added = set(counting.get_added_tokens_decoder())
    rng = random.Random(2)
    plain = [i for i in range(len(tokenizer)) if i not in added]
    for _ in range(3000):  # random ids: most sequences cut a character or hold stray continuation bytes
        ids = [rng.choice(plain) for _ in range(rng.randint(0, 8))]
        assert decode(ids) == counting.backend.decode(ids, skip_special_tokens=skip_special_tokens)
    assert counting.calls == 0
    ids = tokenizer(TEXT)["input_ids"][:6] + [min(added)] + tokenizer(TEXT)["input_ids"][6:9]
    assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) and counting.calls == 1


def test_no_byte_table_for_a_decoder_that_is_not_byte_level():
    from tokenizers import Tokenizer, decoders, models

    from engine.core.detokenizer import byte_table

    word_piece = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    word_piece.decoder = decoders.WordPiece()
    assert byte_table(word_piece) is None
