"""llama-server's teacher-forced agreement probe without the server: reading an answer, the
re-ask of a position whose token is outside the listed top-k, and the comparison's arithmetic."""
from __future__ import annotations

import math

import pytest

from bench.probes.llama_server_agreement import compare, position_logprobs, teacher_forced_peer


def test_position_logprobs_reads_the_first_position_best_first():
    body = {"content": "x", "completion_probabilities": [
        {"id": 7, "logprob": -0.1, "top_logprobs": [{"id": 7, "token": "a", "logprob": -0.1},
                                                    {"id": 3, "token": "b", "logprob": -2.5}]}]}
    assert position_logprobs(body) == (7, {7: -0.1, 3: -2.5})
    with pytest.raises(ValueError, match="top_logprobs"):
        position_logprobs({"content": "x"})


def test_teacher_forced_peer_asks_again_with_every_token_where_the_target_is_not_listed():
    vocab = 5
    # log-probabilities after each prefix length (1, 2, 3): the arg-max first
    table = {1: [-0.2, -1.9, -3.0, -4.0, -5.0], 2: [-4.0, -0.1, -2.6, -5.0, -6.0], 3: [-1.0, -1.5, -2.0, -0.9, -7.0]}
    asked = []

    def ask(prefix, n_probs):
        asked.append((len(prefix), n_probs))
        row = table[len(prefix)]
        order = sorted(range(vocab), key=lambda t: -row[t])[:n_probs]
        return order[0], {t: row[t] for t in order}

    tokens = [9, 1, 4, 3]  # the targets: 1 (listed in top 2), 4 (not), 3 (the arg-max)
    got = teacher_forced_peer(ask, tokens, top_k=2, vocab=vocab)
    assert got["top1"] == [0, 1, 3] and got["target_logprobs"] == [-1.9, -6.0, -0.9]
    assert asked == [(1, 2), (2, 2), (2, 5), (3, 2)] and got["asked_again_with_every_token"] == 1


def test_compare_counts_agreement_and_nll_delta():
    ref = {"top1": [1, 2, 3, 4], "target_logprobs": [-1.0, -2.0, -3.0, -2.0]}
    peer = {"top1": [1, 2, 0, 4], "target_logprobs": [-1.0, -2.5, -3.0, -2.1]}
    got = compare(ref, peer)
    assert (got["positions"], got["agree"], got["top1_agreement"]) == (4, 3, 0.75)
    assert got["nll_reference"] == pytest.approx(2.0) and got["nll_delta"] == pytest.approx(0.15)
    assert math.isclose(got["nll_peer"], 2.15)
    with pytest.raises(ValueError, match="position counts"):
        compare(ref, {"top1": [1], "target_logprobs": [-1.0]})
