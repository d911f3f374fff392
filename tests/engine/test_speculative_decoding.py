"""Speculative decoding on the real engine (tiny random Llama): greedy output equals plain greedy
token for token, and the pool ends empty with only accepted tokens under its hashes."""
from __future__ import annotations

import dataclasses
import random

import pytest

from cache.hashing import iter_block_hashes
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SpeculativeConfig
from tests.helpers import tiny_engine, tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# verify_cost_ratio 0, no batch cutoff: every draft is verified (these tests are about the mechanics;
# the adaptive rule has its own tests).
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, verify_cost_ratio=0,
                         disable_by_batch_size=None)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def spec_engine(hf_model, **kw):
    engine = tiny_engine(hf_model, **kw)
    engine.scheduler.config.speculative_config = SPEC
    return engine


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    passage = [rng.randrange(3, 128) for _ in range(11)]
    return [
        passage * 3 + passage[:4],  # copy-heavy: the continuation of a repeated passage
        [rng.randrange(3, 128) for _ in range(23)],
        [rng.randrange(3, 128) for _ in range(5)],
        list(range(10, 40)) + list(range(10, 20)),
    ]


def assert_pool_clean(engine, sequences: list[list[int]]) -> None:
    """Every block free, the manager consistent, and each hashed block one of an accepted sequence."""
    kv = engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    bs = kv.block_size
    accepted = set()
    for seq in sequences:
        accepted.update(iter_block_hashes(seq[:len(seq) // bs * bs], bs))
    stray = [b.block_id for h, b in kv.block_pool.cached_blocks.items() if h not in accepted]
    assert not stray, f"blocks {stray} are hashed under chains no accepted sequence has"


def test_greedy_with_speculation_equals_plain_greedy(hf_model):
    ps = prompts()
    plain = tiny_engine(hf_model).generate(ps, GREEDY)
    engine = spec_engine(hf_model)
    spec = engine.generate(ps, GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = engine.scheduler.stats
    assert stats.spec_num_drafts > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # rejects happened too
    # Fewer steps than tokens: the copy-heavy prompt alone, run again, accepts drafts.
    again = spec_engine(hf_model)
    before = again.scheduler.stats.spec_accepted_tokens
    assert again.generate([ps[0]], GREEDY)[0].token_ids == plain[0].token_ids
    assert again.scheduler.stats.spec_accepted_tokens > before
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])


def test_speculation_with_eos_stop_ids_and_max_tokens(hf_model):
    ps = prompts()
    base = tiny_engine(hf_model).generate(ps, GREEDY)
    stop_id = base[0].token_ids[9]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    plain = tiny_engine(hf_model).generate(ps, params)
    engine = spec_engine(hf_model)
    spec = engine.generate(ps, params)
    assert [(r.token_ids, r.finish_reason) for r in spec] == [(r.token_ids, r.finish_reason) for r in plain]
    assert spec[0].token_ids[-1] == stop_id and len(spec[0].token_ids) <= 10
    assert len(spec[1].token_ids) == 7
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])


def test_logprob_requests_do_not_speculate(hf_model):
    ps = prompts()
    params = [SamplingParams(temperature=0.8, seed=3, logprobs=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True)]
    plain = tiny_engine(hf_model).generate(ps[:2], params)
    engine = spec_engine(hf_model)
    spec = engine.generate(ps[:2], params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.logprobs for r in spec] == [r.logprobs for r in plain]
    assert engine.scheduler.stats.spec_num_drafts == 0


def test_seeded_sampling_and_penalties_speculate_and_emit_the_plain_tokens(hf_model):
    # Rejection sampling draws one uniform per emitted token, the one plain decode draws for it;
    # penalties and min_tokens see the accepted draft tokens (engine/sampling/verification.py).
    ps = prompts()
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=16,
                             ignore_eos=True),
              SamplingParams(temperature=0.6, min_p=0.1, frequency_penalty=0.5, min_tokens=8, seed=7,
                             logit_bias={5: 1.5}, max_tokens=16)]
    plain = tiny_engine(hf_model).generate(ps, params)
    engine = spec_engine(hf_model)
    spec = engine.generate(ps, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = engine.scheduler.stats
    assert stats.spec_num_drafts > 0 and stats.spec_accepted_tokens > 0
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])


def test_preemption_chunked_prefill_and_prefix_hits_keep_speculation_exact(hf_model):
    ps = prompts()
    # Small pool (preemption), a budget below the prompts (chunked prefill), the same prompts
    # twice (prefix hits on blocks that speculative steps filled).
    kw = dict(num_blocks=24, block_size=4, max_num_batched_tokens=16)
    plain = tiny_engine(hf_model, **kw).generate(ps + ps, GREEDY)
    engine = spec_engine(hf_model, **kw)
    spec = engine.generate(ps + ps, GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.spec_accepted_tokens > 0
    second = spec_engine(hf_model, num_blocks=64, max_num_batched_tokens=16)
    second.generate(ps, GREEDY)
    res = second.generate(ps, GREEDY)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain[:len(ps)]]
    assert sum(r.num_cached_tokens for r in res) > 0
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])
    assert_pool_clean(second, [r.prompt_token_ids + r.token_ids for r in res])


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_abort_mid_speculation_frees_everything(hf_model, method):
    ps = prompts()
    engine = spec_engine(hf_model)
    engine.scheduler.config.speculative_config = dataclasses.replace(SPEC, method=method)
    ids = [engine.add_request(p, GREEDY) for p in ps]
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    for step in range(6):
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
        if step == 3:
            engine.abort(ids[0])
            engine.abort(ids[2])
        engine.kv_cache.check_invariants()
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
    plain = tiny_engine(hf_model).generate(ps, GREEDY)
    for rid, ref in zip(ids, plain):  # aborted ones hold a prefix of the plain tokens
        assert seen[rid] == ref.token_ids[:len(seen[rid])]
    assert seen[ids[1]] == plain[1].token_ids
    assert engine.scheduler.stats.spec_accepted_tokens > 0
    assert_pool_clean(engine, [p + seen[rid] for p, rid in zip(ps, ids)])
    drafter = engine.scheduler.drafter()
    assert not getattr(drafter, "live", {})
    if method == "suffix":  # the two that completed are cached, the aborted ones are not
        assert sorted(map(tuple, drafter.cache.sequences.values())) == sorted(tuple(seen[i]) for i in ids[1::2])


def test_python_decode_path_too(hf_model):
    """Verify rows run as extend chunks; with decode_path python every row does (no native)."""
    ps = prompts()
    plain = tiny_engine(hf_model, attention_backend="torch").generate(ps, GREEDY)
    engine = spec_engine(hf_model, attention_backend="torch")
    assert [r.token_ids for r in engine.generate(ps, GREEDY)] == [r.token_ids for r in plain]


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick and polished the great lens until it shone.")


@pytest.fixture
def default_spec(default_engine):
    """The session's default-model engine with speculation switched on for one test."""
    config = default_engine.scheduler.config
    config.speculative_config = SPEC
    try:
        yield default_engine
    finally:
        config.speculative_config = None


def test_default_model_copy_prompt_with_a_stop_string_inside_an_accepted_run(default_spec):
    from engine.tokenizer import encode_chat

    engine = default_spec
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": f"Repeat exactly:\n\n{PASSAGE}"}])
    runs = {}
    for name, params in [("free", SamplingParams(temperature=0.0, max_tokens=48)),
                         ("stop", SamplingParams(temperature=0.0, max_tokens=48, stop=["wound the"]))]:
        before = engine.scheduler.stats.spec_accepted_tokens
        engine.scheduler.config.speculative_config = SPEC
        spec = engine.generate([prompt], params)[0]
        accepted = engine.scheduler.stats.spec_accepted_tokens - before
        engine.scheduler.config.speculative_config = None
        engine.kv_cache.reset_prefix_cache()
        plain = engine.generate([prompt], params)[0]
        assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        runs[name] = (spec, accepted)
    free, accepted = runs["free"]
    assert "wound the" in free.text and accepted > 0  # the copy accepted drafts
    stopped = runs["stop"][0]
    assert stopped.finish_reason == "stop" and "wound the" not in stopped.text
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_output_processor_cuts_a_multi_token_output_at_its_stop_string(default_engine):
    from engine.core.output_processor import OutputProcessor
    from engine.core.protocol import EngineCoreOutput

    tok = default_engine.tokenizer
    ids = tok("one two three four five", add_special_tokens=False)["input_ids"]
    processor = OutputProcessor(tok)
    processor.add_request("r", [1], SamplingParams(stop=[" three"]), 0.0)
    outs, stopped = processor.process([EngineCoreOutput(request_id="r", new_token_ids=ids, finish_reason=None)])
    assert stopped == ["r"]
    out = outs[0]
    assert out.finish_reason == "stop" and out.text == "one two"
    cut = next(i for i in range(1, len(ids) + 1) if " three" in tok.decode(ids[:i]))
    assert out.new_token_ids == ids[:cut] and out.num_output_tokens == cut


def test_the_adaptive_rule_at_its_defaults_is_exact_too(hf_model):
    """With the default rule (verify_cost_ratio, disable_by_batch_size) whoever drafts or shadows,
    the tokens are plain greedy's, and the pool ends clean."""
    ps = prompts()
    plain = tiny_engine(hf_model).generate(ps + [ps[0]], GREEDY)
    engine = tiny_engine(hf_model)
    engine.scheduler.config.speculative_config = SpeculativeConfig(num_speculative_tokens=4)
    spec = engine.generate(ps, GREEDY) + engine.generate([ps[0]], GREEDY)  # the copy prompt alone too
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])


SUFFIX = dataclasses.replace(SPEC, method="suffix")


def suffix_engine(hf_model, **keys):
    engine = tiny_engine(hf_model)
    engine.scheduler.config.speculative_config = dataclasses.replace(SUFFIX, **keys)
    return engine


def test_suffix_method_greedy_equals_plain_greedy(hf_model):
    ps = prompts()
    plain = tiny_engine(hf_model).generate(ps, GREEDY)
    engine = suffix_engine(hf_model)
    spec = engine.generate(ps, GREEDY)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    stats = engine.scheduler.stats
    assert stats.spec_accepted_tokens > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    drafter = engine.scheduler.drafter()
    assert not drafter.live  # nothing kept per request once all finished
    assert len(drafter.cache) == len(ps)
    spec_config, engine.scheduler.config.speculative_config = engine.scheduler.config.speculative_config, None
    engine.generate(ps[:1], GREEDY)  # speculation off: its output is not cached
    engine.scheduler.config.speculative_config = spec_config
    assert engine.scheduler.drafter() is drafter and len(drafter.cache) == len(ps)
    assert_pool_clean(engine, [r.prompt_token_ids + r.token_ids for r in spec])


def test_suffix_drafts_from_a_previous_requests_output(hf_model):
    """An agent-like repeat (a retried step, a repeated rollout): the second run of the same prompt
    drafts from the first run's cached output, which its own prompt does not hold."""
    prompt = prompts()[1]
    plain = tiny_engine(hf_model).generate([prompt], GREEDY)[0].token_ids

    def accepted_in_second_run(cached: int) -> int:
        engine = suffix_engine(hf_model, suffix_decoding_max_cached_requests=cached)
        assert engine.generate([prompt], GREEDY)[0].token_ids == plain
        before = engine.scheduler.stats.spec_accepted_tokens
        assert engine.generate([prompt], GREEDY)[0].token_ids == plain
        return engine.scheduler.stats.spec_accepted_tokens - before

    with_cache, without = accepted_in_second_run(1000), accepted_in_second_run(0)
    assert with_cache > without and with_cache >= len(plain) // 2, (with_cache, without)
