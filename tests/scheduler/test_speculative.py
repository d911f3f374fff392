"""Speculative decoding in the scheduler, with a fake model and a simulated KV store (no torch).

The fake model's greedy token depends on the last two tokens only, so outputs turn periodic
and n-gram drafts are often right (accepts) and sometimes wrong (rejects). The simulated store
writes each run position's token into the slot the block table maps it to, so a wrong block
table, a rollback that frees a live block or a rejected token left in a hashed block shows up.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache import KVCacheManager
from cache.hashing import iter_block_hashes
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig, SpeculativeConfig
from scheduler.output import SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.drafting.ngram import propose_ngram
from scheduler.speculative import (ACCEPTANCE_WEIGHT, can_speculate, check_run, choose_speculators,
                                   expected_tokens, observe_acceptance)

EOS = 2


def oracle(tokens: list[int]) -> int:
    """The fake model's greedy next token (never EOS unless the sequence asks for it)."""
    a, b = (tokens[-2] if len(tokens) > 1 else 0), tokens[-1]
    return 3 + (a * 7 + b * 3) % 6


# ---- config ------------------------------------------------------------------------------------
def test_config_parses_vllm_json_and_defaults_off():
    assert SchedulerConfig().speculative_config is None
    cfg = SchedulerConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, '
                                             '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert cfg.speculative_config == SpeculativeConfig("ngram", 5, 2, 4)
    assert SchedulerConfig(speculative_config={"method": "ngram"}).speculative_config == SpeculativeConfig()


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle"}', "method must be one of ngram"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) must be <="),
    ('{"method": "ngram", "lookahead": 2}', "unknown key(s) in speculative_config: lookahead"),
    ('{"num_speculative_tokens": 2}', "needs a method"),
    ("ngram", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_config_rejects_bad_values_with_a_clear_message(value, message):
    with pytest.raises(ValueError) as info:
        SchedulerConfig(speculative_config=value)
    assert message in str(info.value)


def test_cli_flag_reaches_the_scheduler_config_and_bad_values_fail_at_start(capsys):
    import argparse

    from kvserve.cli import add_engine_args, build_engine_config, main

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config, _ = build_engine_config(args)
    assert config.scheduler.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    config, _ = build_engine_config(parser.parse_args([]))
    assert config.scheduler.speculative_config is None
    assert main(["generate", "hi", "--speculative-config", '{"method": "eagle"}']) == 2
    assert "speculative_config.method must be one of ngram, suffix, got 'eagle'" in capsys.readouterr().err


def test_profile_mapping_builds_the_config(tmp_path):
    from configs import build_section, read_profile

    path = tmp_path / "p.yaml"
    path.write_text("scheduler:\n  speculative_config: {method: ngram, num_speculative_tokens: 2}\n")
    cfg = build_section(SchedulerConfig, "scheduler", read_profile(path), {})
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    flag = '{"method": "ngram", "num_speculative_tokens": 6}'  # the flag overrides the profile's key
    cfg = build_section(SchedulerConfig, "scheduler", read_profile(path), {"speculative_config": flag})
    assert cfg.speculative_config.num_speculative_tokens == 6
    for shipped in ("cpu", "gpu"):
        assert build_section(SchedulerConfig, "scheduler", read_profile(
            Path(__file__).parents[2] / "configs" / f"{shipped}.yaml"), {}).speculative_config is None


# ---- drafts and acceptance ---------------------------------------------------------------------
def test_propose_takes_the_longest_most_recent_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 1, 3) == [7, 5, 2]  # "2 3", the later one
    assert propose_ngram([4, 1, 2, 3, 8, 8, 1, 2, 3], 2, 1, 3) == [8, 8]
    assert propose_ngram([1, 2, 5, 1, 2, 6, 1, 2], 4, 1, 3) == [6, 1, 2]  # most recent of two equal matches
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([5, 6, 5], 3, 2, 3) == []  # only a 1-gram matches, min is 2
    assert propose_ngram([7, 7, 7], 4, 1, 3) == [7]  # the match's follower is the last token
    assert propose_ngram([1], 3, 1, 3) == []


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The fake model's verification: the longest draft prefix equal to its argmaxes, then its
    argmax after it (what engine/sampling/verification.py does for a greedy row)."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return targets[:n + 1]


def test_check_run_takes_what_a_verification_may_emit():
    for run in ([5, 6, 7, 8], [5, 9], [4], [5, 6, 7]):
        check_run([5, 6, 7], run)
    for run in ([], [5, 6, 7, 8, 9], [4, 6], [5, 7, 1]):
        with pytest.raises(ValueError, match="does not continue an accepted prefix"):
            check_run([5, 6, 7], run)


@pytest.mark.parametrize("params, speculates", [
    (dict(temperature=0.0), True),
    (dict(temperature=0.7), True),  # rejection sampling
    (dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3), True),
    (dict(temperature=0.0, logprobs=0), False),
    (dict(temperature=0.9, logprobs=2), False),
    (dict(temperature=0.0, logit_bias={5: 1.0}), True),  # verified per position with the sampler's steps
    (dict(temperature=0.0, repetition_penalty=1.1), True),
    (dict(temperature=0.5, presence_penalty=0.5), True),
    (dict(temperature=0.0, min_tokens=3), True),
])
def test_who_speculates(params, speculates):
    r = Request("r", [3, 4, 5], SamplingParams(max_tokens=8, **params), max_tokens=8)
    assert can_speculate(r) is speculates


# ---- the scheduler with a simulated model and KV store ----------------------------------------
class Sim:
    """A Scheduler with a fake model that writes tokens into a simulated paged store."""

    def __init__(self, num_blocks: int, block_size: int, budget: int = 32, k: int = 4,
                 prefix_caching: bool = True, max_model_len: int = 96, method: str = "ngram", **rule) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, prefix_caching)
        # By default every draft is verified (verify_cost_ratio 0, no batch cutoff): the tests
        # are about the mechanics; ``rule`` sets the adaptive rule's knobs for its own tests.
        rule = {"verify_cost_ratio": 0, "disable_by_batch_size": None, **rule}
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
                                 **rule)
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                           max_model_len=max_model_len, speculative_config=spec), self.kv)
        self.store: dict[int, int | None] = {}  # slot -> token whose KV it holds
        self.finished: list[list[int]] = []  # token sequences of requests that finished with stop/length
        self.rejected = 0
        self.last_position = -1  # the furthest position any step ran

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        assert out.num_batched_tokens <= self.s.config.max_num_batched_tokens
        sampled, verified = {}, {}
        for item in out.scheduled:
            r, start = item.request, item.request.num_computed_tokens
            run = item.input_token_ids()
            assert len(run) == item.num_new_tokens
            seq = r.all_token_ids[:start] + run
            self.last_position = max(self.last_position, start + item.num_new_tokens - 1)
            for pos in range(start, start + item.num_new_tokens):  # write, then "attend"
                self.store[item.block_ids[pos // self.bs] * self.bs + pos % self.bs] = seq[pos]
            for pos in range(start + item.num_new_tokens):
                assert self.store.get(item.block_ids[pos // self.bs] * self.bs + pos % self.bs) == seq[pos], \
                    f"{r.request_id}: position {pos} reads another token's KV"
            if item.draft_token_ids:
                targets = [oracle(seq[:p + 1]) for p in range(start, start + item.num_new_tokens)]
                accepted = verified[r.request_id] = accept_greedy(item.draft_token_ids, targets)
                self.rejected += len(item.draft_token_ids) - (len(accepted) - 1)
            elif item.samples:
                sampled[r.request_id] = oracle(seq)
        live = [x.request for x in out.scheduled]
        self.s.update(out, sampled, verified)
        for r in live:
            if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.finished.append(list(r.all_token_ids))
        self.kv.check_invariants()
        for r in self.s.running:  # holds exactly the blocks of its computed tokens, as plain decode
            if r.num_computed_tokens == r.num_tokens - 1:
                assert len(self.kv.get_blocks(r.request_id)) == -(-r.num_computed_tokens // self.bs)
        return out

    def check_hash_chain(self, live: list[Request]) -> None:
        """Every hashed block is a block of an accepted token sequence and holds those tokens."""
        expected = {}
        for seq in self.finished + [list(r.all_token_ids) for r in live]:
            full = len(seq) // self.bs * self.bs
            for i, h in enumerate(iter_block_hashes(seq[:full], self.bs)):
                expected[h] = seq[i * self.bs:(i + 1) * self.bs]
        for h, block in self.kv.block_pool.cached_blocks.items():
            assert h in expected, f"block {block.block_id} is hashed under a chain no accepted sequence has"
            slots = [self.store.get(block.block_id * self.bs + j) for j in range(self.bs)]
            assert slots == expected[h], f"block {block.block_id} holds {slots}, its hash says {expected[h]}"


def request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                   max_tokens=max_tokens, eos_token_ids=frozenset([EOS]))


def plain_run(prompt: list[int], max_tokens: int, stop: int | None = None) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        seq.append(oracle(seq))
        out.append(seq[-1])
        if seq[-1] == stop:
            break
    return out


def test_speculation_gives_the_plain_tokens_and_rolls_rejects_back():
    sim = Sim(num_blocks=64, block_size=4)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 9) for _ in range(n)] for n in (5, 9, 14)]
    reqs = [request(f"r{i}", p, 25) for i, p in enumerate(prompts)]
    for r in reqs:
        sim.s.add_request(r)
    steps = 0
    while sim.s.has_unfinished():
        sim.step()
        steps += 1
    assert [r.output_token_ids for r in reqs] == [plain_run(p, 25) for p in prompts]
    st_ = sim.s.stats
    assert st_.spec_accepted_tokens > 0 and sim.rejected > 0
    assert st_.spec_draft_tokens == st_.spec_accepted_tokens + sim.rejected
    per_pos = st_.spec_accepted_per_pos
    assert sum(per_pos) == st_.spec_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= st_.spec_num_drafts
    assert steps < 25 + 3  # accepted drafts saved steps
    sim.check_hash_chain([])
    assert sim.kv.num_free_blocks == sim.kv.num_blocks


def test_stop_inside_an_accepted_run_truncates_it():
    sim = Sim(num_blocks=64, block_size=4)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    plain = plain_run(prompt, 30)
    stop = plain[6]
    r = request("r", prompt, 30, stop_token_ids=[stop])
    sim.s.add_request(r)
    while sim.s.has_unfinished():
        sim.step()
    assert r.output_token_ids == plain_run(prompt, 30, stop=stop)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == stop
    assert sim.kv.num_free_blocks == sim.kv.num_blocks


def test_max_tokens_and_context_length_bound_the_draft():
    sim = Sim(num_blocks=64, block_size=4, max_model_len=20)
    r1 = request("a", [3, 4, 3, 4, 3, 4], 5)
    r2 = request("b", [5, 6, 5, 6, 5, 6, 5, 6], 50)  # the context length ends it at 20 tokens
    for r in (r1, r2):
        sim.s.add_request(r)
    while sim.s.has_unfinished():
        sim.step()
    assert sim.last_position == 18  # max_model_len - 2, as in plain decode: drafts never run past it
    assert r1.output_token_ids == plain_run(r1.prompt_token_ids, 5)
    assert len(r2.all_token_ids) == 20 and r2.status is RequestStatus.FINISHED_LENGTH
    assert r2.output_token_ids == plain_run(r2.prompt_token_ids, 12)


def test_budget_counts_draft_tokens():
    sim = Sim(num_blocks=64, block_size=4, budget=6, k=4)
    reqs = [request(f"r{i}", [3, 4, 3, 4, 3, 4, 3], 12) for i in range(3)]
    for r in reqs:
        sim.s.add_request(r)
    while sim.s.has_unfinished():
        sim.step()  # asserts num_batched_tokens <= budget
    assert all(r.output_token_ids == plain_run(r.prompt_token_ids, 12) for r in reqs)


class SpecMachine(RuleBasedStateMachine):
    """Accept, reject, preempt (a small pool), abort and prefix hits in any order: the outputs are
    plain decode's, the pool stays consistent, and the hash chain holds only accepted tokens."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 20),
                k=st.integers(1, 5), prefix_caching=st.booleans(), method=st.sampled_from(["ngram", "suffix"]))
    def setup(self, block_size, num_blocks, k, prefix_caching, method):
        self.max_len = min(40, num_blocks * block_size)  # one request alone always fits the pool
        self.sim = Sim(num_blocks, block_size, budget=12, k=k, prefix_caching=prefix_caching,
                       max_model_len=self.max_len, method=method)
        self.expected: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}
        self.n = 0

    @rule(prompt=st.lists(st.integers(3, 6), min_size=1, max_size=12), max_tokens=st.integers(1, 16),
          copy=st.booleans())
    def add(self, prompt, max_tokens, copy):
        if copy and self.reqs:  # share a prefix with an earlier request: prefix hits
            prompt = list(next(iter(self.reqs.values())).prompt_token_ids) + prompt[:3]
        prompt = prompt[:self.max_len - 1]
        rid = f"r{self.n}"
        self.n += 1
        r = request(rid, prompt, max_tokens)
        self.reqs[rid] = r
        self.expected[rid] = plain_run(prompt, min(max_tokens, self.max_len - len(prompt)))
        self.sim.s.add_request(r)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            if self.sim.s.has_unfinished():
                self.sim.step()

    @rule(data=st.data())
    def abort(self, data):
        live = [rid for rid, r in self.reqs.items() if not r.status.is_finished]
        if live:
            rid = data.draw(st.sampled_from(live))
            self.sim.s.abort(rid)
            self.sim.finished.append(list(self.reqs[rid].all_token_ids))  # its blocks stay cached
            del self.expected[rid]

    @invariant()
    def consistent(self):
        if hasattr(self, "sim"):
            self.sim.kv.check_invariants()
            drafter = self.sim.s.drafter()  # keeps per-request state only for live requests
            assert set(getattr(drafter, "live", {})) <= set(self.sim.s.requests)
            for rid, r in self.reqs.items():
                if rid in self.expected:  # a prefix of plain decode's tokens, all along
                    assert r.output_token_ids == self.expected[rid][:len(r.output_token_ids)]

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        for _ in range(500):
            if not self.sim.s.has_unfinished():
                break
            self.sim.step()
        assert not self.sim.s.has_unfinished()
        for rid, r in self.reqs.items():
            if rid in self.expected:
                assert r.output_token_ids == self.expected[rid]
        self.sim.check_hash_chain([])
        assert self.sim.kv.num_free_blocks == self.sim.kv.num_blocks


TestSpecMachine = SpecMachine.TestCase
TestSpecMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# ---- the adaptive rule ---------------------------------------------------------------------------
DEFAULT_RULE = {"verify_cost_ratio": SpeculativeConfig.verify_cost_ratio,
                "disable_by_batch_size": SpeculativeConfig.disable_by_batch_size}


def test_expected_tokens_and_the_acceptance_estimate():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert observe_acceptance(0.5, 4, 4) > observe_acceptance(0.5, 3, 4) > 0.5  # 3 accepts, 1 reject
    assert observe_acceptance(0.5, 0, 4) == pytest.approx(0.5 * (1 - ACCEPTANCE_WEIGHT))  # one observed reject
    assert observe_acceptance(0.5, 1, 1) == pytest.approx(0.5 + 0.5 * ACCEPTANCE_WEIGHT)
    p = 0.5
    for _ in range(40):
        p = observe_acceptance(p, 0, 4)
    assert p < 0.01


def test_choose_speculators_pays_per_request_then_per_batch_and_stops_at_the_cutoff():
    def req(rid: str, p: float) -> Request:
        r = request(rid, [3, 4, 5], 10)
        r.spec_acceptance = p
        return r

    spec = SpeculativeConfig(verify_cost_ratio=3.0, disable_by_batch_size=8)
    good, fair, poor = req("good", 0.95), req("fair", 0.85), req("poor", 0.3)
    assert choose_speculators([(poor, 4)], 1, spec) == set()
    # good alone brings ~3.5 extra tokens a step; a slower step costs 2 steps of each decoding row
    assert choose_speculators([(good, 4)], 1, spec) == {"good"}
    assert choose_speculators([(good, 4)], 2, spec) == set()
    assert choose_speculators([(good, 4), (fair, 4)], 2, spec) == {"good", "fair"}
    # poor would not pay alone and stays out; good + fair (~6.2 extra tokens) pay for 3 rows (> 6)
    assert choose_speculators([(good, 4), (fair, 4), (poor, 4)], 3, spec) == {"good", "fair"}
    assert choose_speculators([(good, 4), (fair, 4), (poor, 4)], 4, spec) == set()
    assert choose_speculators([(req(f"g{i}", 0.99), 4) for i in range(9)], 9, spec) == set()  # the cutoff
    assert len(choose_speculators([(req(f"g{i}", 0.99), 4) for i in range(8)], 8, spec)) == 8
    # a row budget (the native path's rows): 2 decoding rows + good's 4 + fair's 4 fit in 10; in 8
    # the candidate that brings most goes first, so good stays and fair does not fit
    cheap = SpeculativeConfig(verify_cost_ratio=1.5, disable_by_batch_size=None)
    assert choose_speculators([(good, 4), (fair, 4)], 2, cheap, row_budget=10) == {"good", "fair"}
    assert choose_speculators([(fair, 4), (good, 4)], 2, cheap, row_budget=8) == {"good"}
    assert choose_speculators([(good, 4)], 2, cheap, row_budget=5) == set()
    always = SpeculativeConfig(verify_cost_ratio=0, disable_by_batch_size=None)
    assert choose_speculators([(good, 4)], 2, always, row_budget=5) == {"good"}  # r <= 1: no budget
    assert choose_speculators([(poor, 4), (req("zero", 0.0), 2)], 40, always) == {"poor", "zero"}
    with pytest.raises(ValueError, match="verify_cost_ratio"):
        SpeculativeConfig(verify_cost_ratio=-1)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)
    assert SchedulerConfig(speculative_config='{"method": "ngram", "verify_cost_ratio": 1.2, '
                                              '"disable_by_batch_size": null}').speculative_config == \
        SpeculativeConfig(verify_cost_ratio=1.2, disable_by_batch_size=None)


def test_a_request_not_speculating_learns_from_its_shadow_draft():
    # a cost ratio at which a fresh request's estimate (p = 0.5: 1.94 tokens a 4-token draft) does
    # not pay, so its first draft is a shadow (at the default 1.5 it would be verified)
    sim = Sim(num_blocks=64, block_size=4, verify_cost_ratio=3.0, disable_by_batch_size=8)
    r = request("r", [3, 4, 5, 3, 4, 5, 3, 4], 30)
    sim.s.add_request(r)
    sim.step()  # the prefill
    for _ in range(10):  # decode until the request has a draft: p = 0.5, so it stays a shadow
        out = sim.s.schedule()
        if r.spec_shadow_token is not None:
            break
        sim.s.update(out, {"r": oracle(r.all_token_ids)})
    assert r.spec_shadow_token is not None and not out.scheduled[0].draft_token_ids
    assert r.spec_acceptance == 0.5
    sim.s.update(out, {"r": 100 + r.spec_shadow_token})  # the model disagreed with the shadow draft
    assert r.spec_acceptance < 0.5 and r.spec_shadow_token is None
    before = r.spec_acceptance
    for _ in range(10):  # the fresh token has no earlier occurrence: decode on to the next shadow
        out = sim.s.schedule()
        if r.spec_shadow_token is not None:
            break
        sim.s.update(out, {"r": oracle(r.all_token_ids)})
    assert r.spec_shadow_token is not None and r.spec_acceptance == before
    sim.s.update(out, {"r": r.spec_shadow_token})  # and now agreed
    assert r.spec_acceptance > before


def test_adaptive_rule_turns_speculation_on_for_a_copying_request_and_stays_exact():
    sim = Sim(num_blocks=64, block_size=4, **DEFAULT_RULE)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    r = request("r", prompt, 40)
    sim.s.add_request(r)
    drafted_at = []
    step = 0
    while sim.s.has_unfinished():
        out = sim.step()
        step += 1
        if any(item.draft_token_ids for item in out.scheduled):
            drafted_at.append(step)
    assert r.output_token_ids == plain_run(prompt, 40)
    # The first decode steps only shadow (the estimate starts at 0.5); once the shadows keep
    # being right, it drafts.
    assert drafted_at and drafted_at[0] > 2 and sim.s.stats.spec_accepted_tokens > 0
    sim.check_hash_chain([])
    assert sim.kv.num_free_blocks == sim.kv.num_blocks


def test_no_drafts_above_the_batch_cutoff_and_exact_either_way():
    sim = Sim(num_blocks=256, block_size=4, budget=64, **{**DEFAULT_RULE, "disable_by_batch_size": 2})
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 9) for _ in range(8)] for _ in range(3)]
    reqs = [request(f"r{i}", p, 20) for i, p in enumerate(prompts)]
    for r in reqs:
        sim.s.add_request(r)
    while sim.s.has_unfinished():
        out = sim.step()
        decoding = [i for i in out.scheduled if i.request.num_output_tokens > 0]
        if len(sim.s.running) + len([i for i in out.scheduled if i.request.status.is_finished]) > 2:
            assert not any(i.draft_token_ids for i in decoding)
    assert [r.output_token_ids for r in reqs] == [plain_run(p, 20) for p in prompts]
    assert sim.s.stats.spec_num_drafts == 0  # three decode together until they all end at 20 tokens
