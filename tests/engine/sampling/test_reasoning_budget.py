"""The reasoning budget and the grammar's start after ``</think>`` (engine/sampling/reasoning.py).

Against the real engine: a budgeted request's tokens are the unbudgeted request's tokens up to the
budget (same greedy argmax, or the same seeded draws), then exactly the closing tag's ids, then the
output goes on; on the default model, through the engine core process (the spec crosses the pipe)
and its native decode path, and with a JSON grammar that starts only after the tag.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.sampling.reasoning import ANSWER, BEFORE, THINKING, ReasoningState, needs_state
from kvtypes.reasoning_spec import ReasoningSpec
from kvtypes.sampling_params import SamplingParams
from kvtypes.structured_spec import StructuredOutputSpec
from scheduler.request import Request
from scheduler.speculative import can_speculate
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model

START, END = (40,), (41, 42)  # a one-token <think> and a two-token </think> on the tiny model
PROMPT = [5, 9, 17, 33, 2, 11]


# ---- the state alone -------------------------------------------------------------------------
def test_budget_forces_every_token_of_the_closing_tag_then_lets_go():
    state = ReasoningState(ReasoningSpec(START, END, starts_inside=True, budget=2))
    seen = []
    for sampled in (7, 8, 9, 9, 9, 9):
        token = state.forced_token() if state.forced_token() is not None else sampled
        seen.append((token, state.grammar_active))
        state.accept(token)
    assert seen == [(7, False), (8, False), (41, False), (42, False), (9, True), (9, True)]
    assert state.phase == ANSWER and state.num_reasoning_tokens == 2


def test_the_model_closing_the_block_itself_ends_the_count():
    state = ReasoningState(ReasoningSpec(START, END, starts_inside=True, budget=10))
    for token in (7, 41, 42):
        assert state.forced_token() is None
        assert state.accept(token) is False
    assert state.phase == ANSWER and state.accept(5) is True


def test_before_the_output_a_one_token_open_tag_is_allowed_and_opens_the_block():
    state = ReasoningState(ReasoningSpec(START, END, budget=0))
    assert state.phase == BEFORE and state.open_token == 40 and state.grammar_active
    assert state.accept(40) is False and state.phase == THINKING and not state.grammar_active
    assert state.forced_token() == 41  # a budget of 0: closed at once
    other = ReasoningState(ReasoningSpec(START, END, budget=3))
    assert other.accept(6) is True and other.phase == ANSWER and other.forced_token() is None
    several = ReasoningState(ReasoningSpec((40, 43), END))
    assert several.open_token is None  # a several-token tag is not offered beside a grammar


def test_only_a_budget_or_a_grammar_needs_state_and_such_requests_do_not_speculate():
    spec = ReasoningSpec(START, END, starts_inside=True)
    assert not needs_state(None, True) and not needs_state(spec, False) and needs_state(spec, True)
    assert needs_state(ReasoningSpec(START, END, budget=1), False)
    request = Request(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(temperature=0),
                      max_tokens=8, eos_token_ids=frozenset())
    assert can_speculate(request)
    request.reasoning = ReasoningState(spec)
    assert not can_speculate(request)


@pytest.mark.parametrize("budget", [-1, True, "3"])
def test_a_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ReasoningSpec(START, END, budget=budget)


# ---- the tiny engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return tiny_engine(tiny_hf_model())


def _tokens(engine, budget: int | None, end: tuple[int, ...] = END, **params) -> list[int]:
    spec = ReasoningSpec(START, end, starts_inside=True, budget=budget) if budget is not None else None
    base = dict(max_tokens=14, ignore_eos=True, temperature=0.0)
    return engine.generate([PROMPT], SamplingParams(**{**base, **params}, reasoning=spec))[0].token_ids


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
@pytest.mark.parametrize("budget", [0, 5])
def test_budgeted_output_is_the_free_one_cut_at_the_budget_then_the_tag(engine, budget, sampling):
    free = _tokens(engine, None, **sampling)
    capped = _tokens(engine, budget, **sampling)
    assert free[budget:budget + 2] != list(END)
    assert capped[:budget] == free[:budget] and capped[budget:budget + 2] == list(END)
    assert len(capped) == 14  # generation goes on after the tag


def test_budget_in_a_batch_leaves_the_other_rows_alone(engine):
    free = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    capped = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0,
                            reasoning=ReasoningSpec(START, END, starts_inside=True, budget=2))
    alone = engine.generate([PROMPT], free)[0].token_ids
    together = engine.generate([PROMPT, PROMPT], [free, capped])
    assert together[0].token_ids == alone and together[1].token_ids[2:4] == list(END)


def test_a_model_that_closes_the_block_is_not_forced(engine):
    """logit_bias makes the model write a one-token tag at once: the budget then has nothing to cut
    (were the block still open, the 4th token would be the forced 44)."""
    bias = {41: 100.0}
    free = _tokens(engine, None, logit_bias=bias)
    assert free == [41] * 14 and _tokens(engine, 3, end=(41,), logit_bias=bias) == free
    assert _tokens(engine, 3, end=(44,), logit_bias=bias)[3] == 44


# ---- the default model, through the core process ---------------------------------------------
@pytest.mark.slow
def test_core_process_native_decode_budget_and_grammar_after_the_tag():
    import argparse

    from engine.core.process_client import MPEngineClient
    from kvserve.cli import add_engine_args, build_engine_config

    require_native_kernel()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config, _ = build_engine_config(parser.parse_args(["--num-threads", "1", "--max-model-len", "256",
                                                       "--decode-path", "native"]))
    client = MPEngineClient(config)
    client.start()
    tok = client.tokenizer
    start, end = (tuple(tok.encode(t, add_special_tokens=False)) for t in ("<think>", "</think>"))
    prompt = tok.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n")

    async def run(params: SamplingParams) -> list[int]:
        return [t async for out in client.generate(prompt, params) for t in out.new_token_ids]

    try:
        free = asyncio.run(run(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
        spec = ReasoningSpec(start, end, starts_inside=True, budget=6)
        json_grammar = StructuredOutputSpec("json_object")
        out = asyncio.run(run(SamplingParams(temperature=0.0, max_tokens=60, reasoning=spec,
                                             structured_output=json_grammar)))
        assert out[:6] == free and out[6:6 + len(end)] == list(end)
        answer = tok.decode(out[6 + len(end):])
        assert isinstance(json.loads(answer), dict), answer  # the grammar held the answer, and only it
        unheld = asyncio.run(run(SamplingParams(temperature=0.0, max_tokens=6, structured_output=json_grammar)))
        assert tok.decode(unheld).startswith("{")  # without the spec the grammar holds the first token
    finally:
        client.shutdown()
