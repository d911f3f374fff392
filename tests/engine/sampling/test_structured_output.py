"""Constrained decoding against real llguidance grammars over the default model's tokenizer:
the bitmask really sets every disallowed token to -inf, logit_bias forces and bans, a pending
grammar never stalls other requests, and a broken grammar fails its request only."""
from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

from engine.core.output_processor import OutputProcessor
import torch

from engine.sampling.sampler import Sampler, SamplingRow, apply_grammar
from kvtypes.sampling_params import SamplingParams
from engine.sampling.structured_output import (GrammarCompiler, GrammarError, RequestGrammar, apply_bitmask,
                                      grammar_definition, validate_spec)
from kvtypes.structured_spec import StructuredOutputSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(default_engine):
    return default_engine.tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer, default_engine):
    c = GrammarCompiler(tokenizer, default_engine.arch.vocab_size)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def token_texts(tokenizer, default_engine):
    return [tokenizer.decode([t]) for t in range(default_engine.arch.vocab_size)]


def _grammar(compiler, spec) -> RequestGrammar:
    g = RequestGrammar(compiler.submit(spec))
    g._future.result(timeout=60)
    assert g.resolve(), g.error
    return g


def test_the_compile_thread_runs_nicer_than_the_engine(compiler):
    """Compiles take a core from the engine's threads only at a lower priority: the compile
    thread's niceness is the process's plus COMPILE_NICENESS (at most 19)."""
    import os
    import threading

    from engine.sampling.structured_output import COMPILE_NICENESS

    tid = compiler._executor.submit(threading.get_native_id).result(timeout=60)
    assert tid != threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's: the engine's priority
    assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base + COMPILE_NICENESS) > base


def test_apply_bitmask_matches_a_bit_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    out = logits.clone()
    apply_bitmask(out, mask)
    for r in range(3):
        for t in range(vocab):
            allowed = (int(mask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == logits[r, t]) if allowed else torch.isneginf(out[r, t])


def test_grammar_mask_is_exactly_the_allowed_tokens(compiler, token_texts, default_engine):
    """Choice grammar "yes" | "no": the first token may be any token whose text is a non-empty
    prefix of one of them (oracle: plain string checks over the whole vocabulary)."""
    g = _grammar(compiler, StructuredOutputSpec("choice", json.dumps(["yes", "no"])))
    vocab = default_engine.arch.vocab_size
    logits = torch.randn(1, vocab)
    work = logits.clone()
    apply_grammar(work, [SamplingRow(SamplingParams(), [1], [], None, grammar=g)])
    expected = {t for t, s in enumerate(token_texts) if s and ("yes".startswith(s) or "no".startswith(s))}
    finite = set(torch.isfinite(work[0]).nonzero().flatten().tolist())
    assert expected and finite == expected
    assert torch.equal(work[0, sorted(finite)], logits[0, sorted(finite)])  # allowed ones untouched


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_follow_the_grammar(compiler, tokenizer, default_engine, temperature):
    """Driving the matcher with the batched sampler on random logits yields text of the regex."""
    spec = StructuredOutputSpec("regex", r"[0-9]{2,4}-[a-z]+")
    vocab = default_engine.arch.vocab_size
    sampler = Sampler()
    gen = torch.Generator().manual_seed(3)
    grammars = [_grammar(compiler, spec) for _ in range(3)]
    outputs: list[list[int]] = [[], [], []]
    params = SamplingParams(temperature=temperature, max_tokens=16, seed=1)
    eos = frozenset(default_engine.arch.eos_token_ids)
    for _ in range(16):
        live = [i for i in range(3) if not grammars[i].is_terminated]
        if not live:
            break
        rows = [SamplingRow(params, [1], outputs[i], torch.Generator().manual_seed(i), eos, grammar=grammars[i])
                for i in live]
        result = sampler(torch.randn(len(live), vocab, generator=gen) * 5, rows)
        for i, token in zip(live, result.token_ids):
            if token in eos:
                grammars[i].accept(token)
                grammars[i].error = grammars[i].error or "done"
                continue
            assert grammars[i].accept(token), grammars[i].error
            outputs[i].append(token)
    import re
    for ids in outputs:
        text = tokenizer.decode(ids)
        assert re.fullmatch(r"[0-9]{2,4}-[a-z]*", text), text


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logit_bias_forces_and_bans(temperature):
    vocab = 100
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    top = logits.argmax(dim=-1)
    rows = [SamplingRow(SamplingParams(temperature=temperature, logit_bias={17: 100}), [1], [], None),
            SamplingRow(SamplingParams(temperature=temperature, logit_bias={int(top[1]): -100}), [1], [], None),
            SamplingRow(SamplingParams(temperature=temperature, logit_bias={42: 100}), [1], [], None),
            SamplingRow(SamplingParams(temperature=temperature), [1], [], None)]
    for _ in range(20):
        out = Sampler()(logits, rows).token_ids
        assert out[0] == 17 and out[2] == 42 and out[1] != int(top[1])


def test_logit_bias_validation():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1})
    assert SamplingParams(logit_bias={"5": -100}).logit_bias == {5: -100.0}


def test_bad_specs_are_refused_before_compiling():
    for spec in [StructuredOutputSpec("json_schema", "{not json"),
                 StructuredOutputSpec("json_schema", json.dumps({"properties": {"a": {"$ref": "#/nope"}}})),
                 StructuredOutputSpec("choice", "[]")]:
        with pytest.raises(GrammarError):
            validate_spec(spec)
    assert "x-guidance" in grammar_definition(StructuredOutputSpec("json_object"))


def test_pending_grammar_does_not_stall_other_requests(default_engine):
    """A request whose grammar is still compiling waits; the others step meanwhile; once the
    grammar is ready the request runs, and its output follows the grammar."""
    engine = default_engine
    real_submit = engine.grammars.submit
    pending: Future = Future()
    engine.grammars.submit = lambda spec: pending
    try:
        spec = StructuredOutputSpec("regex", "(yes|no)")
        slow = engine.add_request("Answer:", SamplingParams(max_tokens=5, temperature=0, structured_output=spec))
        slow_prompt = list(engine.scheduler.requests[slow].prompt_token_ids)
        free = engine.add_request("Once upon a time", SamplingParams(max_tokens=4, temperature=0))
        outputs: dict[str, list] = {slow: [], free: []}
        for _ in range(4):
            for out in engine.step():
                outputs[out.request_id].append(out)
        assert len(outputs[free]) == 4 and outputs[free][-1].finished
        assert outputs[slow] == [] and engine.scheduler.requests[slow].num_computed_tokens == 0
        pending.set_result(real_submit(spec).result(timeout=60))
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].append(out)
        # step() returns token ids; the output processor (the frontend's) makes the text
        processor = OutputProcessor(engine.tokenizer)
        processor.add_request(slow, slow_prompt, SamplingParams(max_tokens=5, temperature=0, structured_output=spec), 0.0)
        texts, _ = processor.process(outputs[slow])
        text = "".join(o.text for o in texts)
        assert text in ("yes", "no") and outputs[slow][-1].finish_reason == "stop"
    finally:
        engine.grammars.submit = real_submit


def test_failed_grammar_fails_only_its_request(default_engine):
    engine = default_engine
    real_submit = engine.grammars.submit
    broken: Future = Future()
    broken.set_exception(GrammarError("boom"))
    engine.grammars.submit = lambda spec: broken
    try:
        bad = engine.add_request("x", SamplingParams(max_tokens=3, structured_output=StructuredOutputSpec("json_object")))
    finally:
        engine.grammars.submit = real_submit
    ok = engine.add_request("Hello", SamplingParams(max_tokens=3, temperature=0))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[bad].finish_reason == "error" and "boom" in finals[bad].error
    assert finals[ok].finish_reason == "length"
    assert engine.kv_cache.usage == 0
