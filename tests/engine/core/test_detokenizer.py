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
    assert any("🙂" in d for d in deltas)  # a 4-byte character (four byte tokens) arrives whole


def test_a_stop_string_is_never_streamed(tokenizer):
    output = tokenizer(TEXT)["input_ids"]
    deltas, detok = _stream(tokenizer, [1, 2, 3], output, stop=["return"])
    assert detok.stopped_on == "return"
    assert "".join(deltas) == TEXT[:TEXT.index("return")]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_equals_transformers_decode_at_every_step(tokenizer, skip_special_tokens, monkeypatch):
    assert not tokenizer.clean_up_tokenization_spaces  # so the backend's decode is taken
    decode = tokenizer.decode
    rng = random.Random(1)
    output = (tokenizer(TEXT)["input_ids"] + [rng.randrange(len(tokenizer)) for _ in range(300)]
              + list(tokenizer.all_special_ids))
    fast = IncrementalDetokenizer(tokenizer, output[:5], skip_special_tokens=skip_special_tokens)
    wrapped = IncrementalDetokenizer(tokenizer, output[:5], skip_special_tokens=skip_special_tokens)
    wrapped._decode = lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    monkeypatch.setattr(tokenizer, "decode", None)  # the fast one must not call it
    for token in output[5:]:
        fast.add_token(token), wrapped.add_token(token)
        assert fast.take_delta(False) == wrapped.take_delta(False)
    assert fast.text == wrapped.text
