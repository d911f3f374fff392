"""Unit tests for engine.sampling.sampler and kvtypes.sampling_params."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.sampler import Sampler, SamplingRow, _inverse_cdf, apply_penalties
from kvtypes.sampling_params import SamplingParams

torch.set_num_threads(1)

VOCAB = 1000


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    **kwargs,
) -> SamplingRow:
    """A row with a seeded generator whenever params.seed is set, as the engine does."""
    params = params or SamplingParams(**kwargs)
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, prompt or [], output or [], generator, eos)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax(sampler: Sampler) -> None:
    logits = random_logits(8)
    out = sampler(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan(sampler: Sampler) -> None:
    """argmax's contract on ties and NaN, in the plain-greedy and the mixed-batch paths: rows of
    few distinct values tie often, and the first maximal index must win (a kernel that returned
    another tied index would change greedy output)."""
    logits = torch.randint(0, 3, (16, VOCAB), generator=torch.Generator().manual_seed(1)).float()
    logits[3] = 2.0
    logits[4, 17] = float("nan")
    want = logits.argmax(dim=-1).tolist()
    assert want[3] == 0 and want[4] == 17
    assert sampler(logits, [row(temperature=0.0) for _ in range(16)]).token_ids == want
    mixed = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0, seed=i) for i in range(16)]
    got = sampler(logits, mixed).token_ids
    assert [got[i] for i in range(0, 16, 2)] == want[::2]


def test_greedy_rows_in_mixed_batch_equal_argmax(sampler: Sampler) -> None:
    logits = random_logits(6)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0, top_p=0.9) for i in range(6)]
    out = sampler(logits, rows)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


@pytest.mark.parametrize("temperature", [1e-6, 1e-2])
def test_temperature_to_zero_equals_greedy(sampler: Sampler, temperature: float) -> None:
    logits = random_logits(16, seed=1)
    # A clear winner per row, so even temperature 1e-2 leaves it with all the mass.
    logits[torch.arange(16), logits.argmax(dim=-1)] += 1.0
    torch.manual_seed(0)
    for _ in range(5):
        out = sampler(logits, [row(temperature=temperature) for _ in range(16)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy(sampler: Sampler) -> None:
    logits = random_logits(16, seed=2, scale=0.5)  # flat: plain sampling would rarely pick argmax
    rows = [row(temperature=1.0, top_k=1, seed=s) for s in range(16)]
    for _ in range(5):
        assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_top_token(sampler: Sampler) -> None:
    logits = random_logits(16, seed=3, scale=0.5)
    rows = [row(temperature=1.0, top_p=1e-6, seed=s) for s in range(16)]
    for _ in range(5):
        assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_input_logits_are_not_modified(sampler: Sampler) -> None:
    logits = random_logits(3)
    before = logits.clone()
    rows = [
        row(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=1.0,
            frequency_penalty=0.5, min_tokens=4, logprobs=2, output=[1, 2, 2], prompt=[5], eos=frozenset({0})),
        row(temperature=0.0, repetition_penalty=2.0, output=[int(logits[1].argmax())]),
        row(temperature=1.0, seed=1),
    ]
    sampler(logits, rows)
    assert torch.equal(logits, before)


def test_rejects_mismatched_batch(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="logits"):
        sampler(random_logits(2), [row()])


# --------------------------------------------------------------------------- seeds


def _decode(sampler: Sampler, steps: torch.Tensor, make_batch) -> list[int]:
    """Sample one token per step for the row under test; make_batch(step_logits, target_row)
    returns (batch_logits, rows, position of the target row)."""
    target = row(temperature=0.9, top_p=0.95, seed=1234)
    tokens = []
    for step_logits in steps:
        logits, rows, position = make_batch(step_logits, target)
        token = sampler(logits, rows).token_ids[position]
        target.output_token_ids = [*target.output_token_ids, token]
        tokens.append(token)
    return tokens


def test_seed_reproducible_regardless_of_batch(sampler: Sampler) -> None:
    steps = random_logits(30, seed=4, scale=1.0)

    def alone(step_logits, target):
        return step_logits.unsqueeze(0), [target], 0

    def crowded(step_logits, target):
        torch.manual_seed(int(step_logits[0].abs().sum() * 1000))  # perturb the default RNG
        others = [
            row(temperature=1.0),
            row(temperature=0.5, top_k=10, seed=7),
            row(temperature=0.0, logprobs=3),
            row(temperature=1.3, min_p=0.05, repetition_penalty=1.2, output=[1, 2, 3]),
        ]
        rows = others[:2] + [target] + others[2:]
        logits = torch.randn(5, VOCAB)
        logits[2] = step_logits
        return logits, rows, 2

    first = _decode(sampler, steps, alone)
    assert _decode(sampler, steps, alone) == first
    assert _decode(sampler, steps, crowded) == first


def test_different_seeds_differ(sampler: Sampler) -> None:
    flat = torch.zeros(1, VOCAB)

    def tokens(seed: int) -> list[int]:
        r = row(temperature=1.0, seed=seed)
        return [sampler(flat, [r]).token_ids[0] for _ in range(20)]

    assert tokens(1) != tokens(2)
    assert tokens(1) == tokens(1)


# --------------------------------------------------------------------------- distributions

# Chi-square critical value at significance 0.001 for df = 5 (6 categories).
CHI2_CRIT_DF5 = 20.52


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_empirical_distribution_matches_softmax(sampler: Sampler, temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    torch.manual_seed(0)
    out = sampler(logits.expand(n, -1), [row(temperature=temperature) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).double()
    assert chi_square(counts, torch.softmax(logits.double() / temperature, dim=0)) < CHI2_CRIT_DF5


def test_empirical_distribution_with_own_generator(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    r = row(temperature=1.0, seed=99)
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(4000):
        counts[sampler(logits, [r]).token_ids[0]] += 1
    assert chi_square(counts, torch.softmax(logits[0].double(), dim=0)) < CHI2_CRIT_DF5


def test_sparse_distribution_across_cdf_blocks(sampler: Sampler) -> None:
    # Vocab not a multiple of the sampler's internal block size; mass only on a few
    # tokens spread over several blocks, everything else impossible.
    vocab = 700
    support = torch.tensor([0, 255, 256, 511, 699])
    logits = torch.full((vocab,), float("-inf"))
    logits[support] = torch.tensor([0.0, 1.0, -0.5, 0.3, 0.7])
    n = 20000
    torch.manual_seed(1)
    out = sampler(logits.expand(n, -1), [row(temperature=1.0) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    assert counts.sum() == counts[support].sum()
    crit_df4 = 18.47
    assert chi_square(counts[support], torch.softmax(logits[support].double(), dim=0)) < crit_df4


def test_inverse_cdf_never_picks_zero_probability_tokens_at_the_extremes() -> None:
    # u = 0 and u = 1 are (nearly) unreachable through the RNG, so hit them directly:
    # zero-probability tokens at either end, and in whole zero blocks, must be skipped.
    probs = torch.zeros(2, 700)
    probs[:, 300] = 0.25
    probs[:, 301] = 0.75
    u = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [300, 301]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # top-k 2: renormalised over tokens 0 and 1.
        (dict(top_k=2), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        # top-p 0.5: token 1 has 0.4 < 0.5 above it, token 2 has 0.7 -> dropped.
        (dict(top_p=0.5), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        # top-p 0.75: token 2 has 0.7 above it -> kept; token 3 has 0.9 -> dropped.
        (dict(top_p=0.75), [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
        # top-k 3 then top-p 0.7 on the renormalised (0.444, 0.333, 0.222): token 2 has
        # 0.778 above it -> dropped.
        (dict(top_k=3, top_p=0.7), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        # min-p 0.6: keep probs >= 0.24.
        (dict(min_p=0.6), [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        # min-p 0.45: keep probs >= 0.18.
        (dict(min_p=0.45), [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),
    ],
)
def test_truncation_distribution(sampler: Sampler, params: dict, expected: list[float]) -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20000
    torch.manual_seed(2)
    out = sampler(probs.log().expand(n, -1), [row(temperature=1.0, **params) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).double()
    expected_t = torch.tensor(expected, dtype=torch.float64)
    assert counts[expected_t == 0].sum() == 0
    assert chi_square(counts, expected_t) < 16.27  # df <= 3, significance 0.001


def test_large_nucleus_falls_back_to_full_ranking(sampler: Sampler) -> None:
    # Flat distribution over 6000 tokens: the nucleus for top_p=0.5 is ~3000 tokens,
    # beyond the first ranking probe. Exactly half the tokens may ever be chosen.
    vocab = 6000
    logits = torch.zeros(vocab)
    logits[:3000] = 1e-3  # the nucleus: slightly more likely
    n = 4000
    torch.manual_seed(3)
    out = sampler(logits.expand(n, -1), [row(temperature=1.0, top_p=0.5) for _ in range(n)])
    tokens = torch.tensor(out.token_ids)
    assert int(tokens.max()) < 3000
    assert len(tokens.unique()) > 2000  # spread over the nucleus, not stuck on a few tokens


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 600),
    data_seed=st.integers(0, 2**31 - 1),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.05, 2.0),
    masked=st.integers(0, 599),
)
def test_sampled_token_always_survives_truncation(
    vocab: int, data_seed: int, top_k: int, top_p: float, min_p: float, temperature: float, masked: int
) -> None:
    logits = random_logits(1, vocab, seed=data_seed)
    logits[0, : min(masked, vocab - 1)] = float("-inf")  # impossible tokens, never all of them
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=data_seed)
    token = Sampler()(logits, [row(params)]).token_ids[0]
    scaled = logits[0] / temperature
    assert math.isfinite(float(scaled[token]))
    if top_k:
        assert int((scaled > scaled[token]).sum()) < top_k
    probs = torch.softmax(scaled, dim=0)
    assert float(probs[token]) >= min_p * float(probs.max()) * (1 - 1e-5)
    above = float(probs[probs > probs[token]].sum())
    if not top_k:
        assert above < top_p + 1e-5


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab = 50
    logits = random_logits(4, vocab, seed=5)
    logits[:, 7] = 0.0  # zero logit: unchanged either way
    specs = [  # (penalty, prompt, output)
        (1.5, [1, 2, 3, 7], [4, 4, 9]),
        (0.7, [10, 11, 11, 12], []),
        (1.0, [1, 2, 3], [4]),  # neutral row in the batch
        (2.0, [], [30, 31, 31, 49, 0]),
    ]
    rows = [row(repetition_penalty=p, prompt=pr, output=out) for p, pr, out in specs]
    ours = logits.clone()
    apply_penalties(ours, rows)
    for i, (penalty, prompt, output) in enumerate(specs):
        input_ids = torch.tensor([prompt + output], dtype=torch.long)
        expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.zeros(2, 10)
    logits[0] = torch.arange(10, dtype=torch.float32)
    rows = [
        row(frequency_penalty=0.25, presence_penalty=0.5, prompt=[7, 7, 8], output=[3, 3, 5, 3]),
        row(prompt=[1], output=[1, 2]),  # no penalties: untouched
    ]
    ours = logits.clone()
    apply_penalties(ours, rows)
    expected = logits.clone()
    expected[0, 3] -= 0.25 * 3 + 0.5
    expected[0, 5] -= 0.25 * 1 + 0.5
    # Prompt-only tokens 7 and 8 are not penalised (OpenAI: output tokens only).
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_negative_presence_penalty_encourages_repeats() -> None:
    logits = torch.zeros(1, 5)
    apply_penalties(logits, [row(presence_penalty=-1.0, frequency_penalty=-0.5, output=[2, 2])])
    torch.testing.assert_close(logits, torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0]]))


def test_repetition_then_frequency_order() -> None:
    logits = torch.tensor([[4.0, -2.0, 1.0]])
    apply_penalties(
        logits, [row(repetition_penalty=2.0, frequency_penalty=1.0, prompt=[1], output=[0, 0])]
    )
    # token 0: 4 / 2 - 1 * 2 = 0; token 1 (prompt only): -2 * 2 = -4; token 2 untouched.
    torch.testing.assert_close(logits, torch.tensor([[0.0, -4.0, 1.0]]))


@pytest.mark.parametrize(
    "penalty", [dict(presence_penalty=0.5), dict(frequency_penalty=0.25), dict(repetition_penalty=1.2)]
)
def test_penalty_flips_greedy_choice(sampler: Sampler, penalty: dict) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.8, 0.5]])
    assert sampler(logits, [row(temperature=0.0, output=[1, 1])]).token_ids == [1]
    assert sampler(logits, [row(temperature=0.0, output=[1, 1], **penalty)]).token_ids == [2]


def test_out_of_vocab_token_ids_are_ignored_by_penalties() -> None:
    logits = torch.ones(1, 4)
    apply_penalties(logits, [row(repetition_penalty=2.0, presence_penalty=1.0, prompt=[9], output=[1, 4])])
    torch.testing.assert_close(logits, torch.tensor([[1.0, -0.5, 1.0, 1.0]]))


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids(sampler: Sampler) -> None:
    eos, stop = 4, 2
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 5.0]])  # eos best, then the stop id

    def pick(generated: int, **kwargs) -> int:
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], **kwargs)
        return sampler(logits, [row(params, output=[0] * generated, eos=frozenset({eos}))]).token_ids[0]

    assert pick(0) == 1
    assert pick(2) == 1
    assert pick(3) == eos  # min_tokens reached: nothing masked any more
    # With ignore_eos, EOS does not end the request, so (as in vLLM) only stop ids are masked.
    assert pick(0, ignore_eos=True) == eos


def test_min_tokens_masks_eos_when_sampling(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 0.0, 8.0]])  # EOS (2) nearly certain
    r = row(temperature=1.0, min_tokens=5, seed=0, eos=frozenset({2}))
    assert all(sampler(logits, [r]).token_ids[0] != 2 for _ in range(200))


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax(sampler: Sampler) -> None:
    logits = random_logits(5, seed=6)
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=0.5, top_k=20, logprobs=20, repetition_penalty=1.5, output=[1, 2]),
        row(temperature=1.0, logprobs=None),
        row(temperature=1.0, logprobs=0, seed=3),
        row(temperature=0.0, logprobs=1, presence_penalty=2.0, output=[int(logits[4].argmax())]),
    ]
    out = sampler(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-5)
    for i, k in [(0, 3), (1, 20), (4, 1)]:
        top = out.top_logprobs[i]
        assert len(top) == k
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in top] == reference[i].topk(k).indices.tolist()
        for token, lp in top:
            assert lp == pytest.approx(float(reference[i, token]), abs=1e-5)
    assert out.top_logprobs[2] == [] and out.top_logprobs[3] == []
    # The penalty moved row 4 off its raw argmax, but its logprob is still the raw one.
    assert out.token_ids[4] != int(logits[4].argmax())


def test_no_logprobs_when_nobody_asks(sampler: Sampler) -> None:
    out = sampler(random_logits(2), [row(temperature=1.0), row(temperature=0.0, repetition_penalty=1.1)])
    assert out.logprobs is None and out.top_logprobs is None


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=3.0), r"temperature must be in \[0, 2\], got 3.0"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k must be an integer"),
        (dict(min_p=1.1), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens must be <= max_tokens"),
        (dict(seed="abc"), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalisation() -> None:
    params = SamplingParams(top_k=-1, stop="###", temperature=1, max_tokens=None, min_tokens=100)
    assert params.top_k == 0
    assert params.stop == ["###"]
    assert isinstance(params.temperature, float)
    assert not params.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert SamplingParams().max_tokens == 16
