"""engine.sampling.verification: a verified draft run against the plain sampler run token by token.

The reference is plain decode: the Sampler draws position i's token for a row whose output already
holds the run so far, and stops after the first token that differs from the draft. Verification must
emit exactly that run, from the same seed (one uniform per emitted token), for greedy and sampled
rows, under penalties, logit_bias, min_tokens and truncation.
"""
from __future__ import annotations

import pytest
import torch

from engine.sampling.sampler import Sampler, SamplingRow
from engine.sampling.verification import verify_drafts
from kvtypes.sampling_params import SamplingParams

VOCAB = 64


def make_row(params: SamplingParams, output: list[int]) -> SamplingRow:
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, [5, 6, 7], list(output), generator, frozenset([2]))


def plain_run(logits: torch.Tensor, params: SamplingParams, output: list[int], draft: list[int]) -> list[int]:
    """What plain decode emits over these positions: one Sampler call per token, same seed."""
    row = make_row(params, output)
    run: list[int] = []
    for i in range(len(draft) + 1):
        token = Sampler()(logits[i:i + 1], [SamplingRow(params, row.prompt_token_ids, output + run, row.generator,
                                                         row.eos_token_ids)]).token_ids[0]
        run.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return run


CASES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.6),
    SamplingParams(temperature=0.0, min_tokens=4),
    SamplingParams(temperature=0.0, logit_bias={9: 2.0}, presence_penalty=1.5),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9, seed=2),
    SamplingParams(temperature=0.7, min_p=0.2, frequency_penalty=0.8, seed=3),
    SamplingParams(temperature=1.0, min_tokens=3, seed=4, logit_bias={2: 5.0}),
]


@pytest.mark.parametrize("trial", range(12))
def test_verified_runs_equal_plain_decode_token_by_token(trial):
    gen = torch.Generator().manual_seed(trial)
    rows, drafts, blocks, expected = [], [], [], []
    for j, params in enumerate(CASES):
        output = torch.randint(3, 12, (trial % 4,), generator=gen).tolist()
        draft = torch.randint(3, 12, (1 + (trial + j) % 4,), generator=gen).tolist()
        # Few tokens dominate (3..11, and EOS), so drafts are often accepted: every path runs.
        logits = torch.randn(len(draft) + 1, VOCAB, generator=gen)
        logits[:, 2:12] += 3.0
        expected.append(plain_run(logits, params, output, draft))
        rows.append(make_row(params, output))
        drafts.append(draft)
        blocks.append(logits)
    logits = torch.cat(blocks)
    before = logits.clone()
    assert verify_drafts(logits, rows, drafts) == expected
    assert torch.equal(logits, before)


def test_greedy_acceptance():
    def one_hot(ids: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(ids), VOCAB).float()

    greedy = make_row(SamplingParams(temperature=0.0), [])
    runs = verify_drafts(torch.cat([one_hot([5, 6, 7, 8]), one_hot([5, 9, 7, 8]), one_hot([4, 1])]),
                         [greedy] * 3, [[5, 6, 7], [5, 6, 7], [5]])
    assert runs == [[5, 6, 7, 8], [5, 9], [4]]  # all accepted + bonus; first mismatch: the model's token


def test_a_temperature_row_accepts_a_certain_draft_and_never_emits_an_impossible_one():
    # p(draft) = 1 at every position: always accepted, bonus drawn; p(draft) = 0: never emitted.
    logits = torch.full((3, VOCAB), -1e9)
    logits[0, 7] = logits[1, 8] = 0.0
    logits[2, 20:30] = 0.0
    params = SamplingParams(temperature=1.0, seed=0)
    run = verify_drafts(logits, [make_row(params, [])], [[7, 8]])[0]
    assert run[:2] == [7, 8] and 20 <= run[2] < 30
    logits[0, 7] = -1e9
    logits[0, 40:44] = 0.0
    for seed in range(20):
        run = verify_drafts(logits, [make_row(SamplingParams(temperature=1.0, seed=seed), [])], [[7, 8]])[0]
        assert len(run) == 1 and 40 <= run[0] < 44


def test_bad_shapes_and_grammar_rows_are_refused():
    row = make_row(SamplingParams(temperature=0.0), [])
    with pytest.raises(ValueError, match="need \\[3, vocab\\] logits"):
        verify_drafts(torch.zeros(2, VOCAB), [row], [[1, 2]])
    with pytest.raises(ValueError, match="grammar"):
        verify_drafts(torch.zeros(2, VOCAB), [SamplingRow(row.params, [], [], None, grammar=object())], [[1]])
