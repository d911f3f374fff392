"""Speculation at temperature > 0 on the real engine (tiny random Llama): the tokens it emits are
distributed as plain sampling's (a two-sample chi-square over many seeded requests, disjoint seeds
for the two arms), and a wrong acceptance rule fails the same test (negative controls).

The requests sample from four tokens (a logit_bias of +6 on them and top_k 4) that make up the
whole copy-heavy prompt, so every n-gram draft is one of them and is accepted about a third of the
time: the accept, residual and bonus paths all run. A presence penalty makes each position's
distribution depend on the tokens before it, accepted draft tokens included.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import engine.model.runner as runner_module
from engine.sampling.sampler import draw, process_logits, sampling_probs
from engine.sampling.verification import _at_position, verify_drafts
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SpeculativeConfig
from tests.helpers import tiny_engine, tiny_hf_model

SYMBOLS = [11, 23, 37, 52]
PROMPT = [SYMBOLS[i] for i in (0, 1, 2, 3) * 4]
N = 1500  # requests per arm
SPEC = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3, verify_cost_ratio=0,
                         disable_by_batch_size=None)
SIGNIFICANCE = 1e-3


def params(seed: int) -> SamplingParams:
    # max_tokens 4: the first token from the prefill, then a 2-token draft verified in one step
    # (positions 2 and 3, the bonus at 4), so positions 2-4 come from verification.
    return SamplingParams(temperature=0.9, top_k=4, presence_penalty=0.6, logit_bias={t: 6.0 for t in SYMBOLS},
                          seed=seed, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model()


def run(hf_model, seeds: range, speculate: bool) -> tuple[list[tuple[int, ...]], object]:
    engine = tiny_engine(hf_model, block_size=16, num_blocks=512, max_num_batched_tokens=1024, max_num_seqs=256)
    if speculate:
        engine.scheduler.config.speculative_config = SPEC
    results = engine.generate([PROMPT] * len(seeds), [params(s) for s in seeds])
    return [tuple(r.token_ids) for r in results], engine.scheduler.stats


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of the two-sample chi-square test that ``a`` and ``b`` (counts per category) come from
    one distribution; categories with fewer than 10 samples in both together are pooled."""
    keys = sorted(set(a) | set(b), key=repr)
    small = [k for k in keys if a[k] + b[k] < 10]
    cells = [(a[k], b[k]) for k in keys if k not in small]
    if small:
        cells.append((sum(a[k] for k in small), sum(b[k] for k in small)))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) if dof else 1.0


def marginals(samples: list[tuple[int, ...]]) -> dict[str, Counter]:
    """What the tests compare: each of the 4 positions, and the pairs of the verified positions."""
    return {"position 1": Counter(s[0] for s in samples), "position 2": Counter(s[1] for s in samples),
            "position 3": Counter(s[2] for s in samples), "position 4": Counter(s[3] for s in samples),
            "positions 1-2": Counter(s[:2] for s in samples), "positions 2-3": Counter(s[1:3] for s in samples)}


def p_values(plain: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> dict[str, float]:
    ref = marginals(plain)
    return {name: chi_square_p(ref[name], counts) for name, counts in marginals(other).items()}


@pytest.fixture(scope="module")
def plain(hf_model):
    samples, stats = run(hf_model, range(N), speculate=False)
    assert stats.spec_num_drafts == 0
    return samples


def test_speculative_sampling_matches_plain_sampling(hf_model, plain):
    samples, stats = run(hf_model, range(N, 2 * N), speculate=True)
    assert {len(s) for s in samples} == {4} and set().union(*samples) <= set(SYMBOLS)
    # Every request verified a draft, and drafts were both accepted and rejected at both positions.
    assert stats.spec_num_drafts >= N
    assert 0.15 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.85 * stats.spec_draft_tokens
    assert len(stats.spec_accepted_per_pos) == 2 and stats.spec_accepted_per_pos[1] > 50
    found = p_values(plain, samples)
    assert min(found.values()) > SIGNIFICANCE, found


def test_seeded_requests_emit_the_plain_tokens_with_speculation(hf_model, plain):
    # One uniform per emitted token, the one plain decode draws for that position: the same seed
    # gives the same tokens (up to float summation order, which these seeds do not meet).
    samples, stats = run(hf_model, range(64), speculate=True)
    assert stats.spec_accepted_tokens > 0
    assert samples == plain[:64]


def accept_every_draft(logits, rows, drafts):
    """Wrong rule: every draft token accepted, then the last token the right rule emitted."""
    return [list(d) + [run[-1]] for d, run in zip(drafts, verify_drafts(logits, rows, drafts))]


def resample_from_p(logits, rows, drafts):
    """Wrong rule: on rejection draw again from the full p instead of the residual (p without x)."""
    positions = [_at_position(r, d, i) for r, d in zip(rows, drafts) for i in range(len(d) + 1)]
    probs = sampling_probs(process_logits(logits, positions), positions)
    runs, start = [], 0
    for row, draft in zip(rows, drafts):
        out = []
        for i in range(len(draft) + 1):
            token = int(draw(probs[start + i:start + i + 1], [row])[0])
            if i < len(draft) and token == draft[i]:
                out.append(token)
                continue
            out.append(int(draw(probs[start + i:start + i + 1], [row])[0]) if i < len(draft) else token)
            break
        runs.append(out)
        start += len(draft) + 1
    return runs


@pytest.mark.parametrize("wrong_rule", [accept_every_draft, resample_from_p])
def test_the_chi_square_test_catches_a_wrong_rule(hf_model, plain, monkeypatch, wrong_rule):
    monkeypatch.setattr(runner_module, "verify_drafts", wrong_rule)
    samples, stats = run(hf_model, range(N, 2 * N), speculate=True)
    assert stats.spec_num_drafts >= N
    found = p_values(plain, samples)
    assert min(found.values()) < SIGNIFICANCE, found
    assert not math.isnan(min(found.values()))
