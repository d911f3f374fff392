"""Teacher-forced top-1 agreement (``bench.agreement``): positions, not text; one forward pass
equals one greedy step per prefix; kvserve's batched prefixes equal one at a time and transformers.
"""
from __future__ import annotations

import pytest

from bench.agreement import per_prefix_top1, prefixes, top1_agreement


# ---- teacher-forced agreement -----------------------------------------------------------------
def test_top1_agreement_counts_positions_not_text():
    ref = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    cand = [5, 6, 99, 8, 9, 10, 11, 12, 13, 14]  # one near-tie: one position, not the rest
    a = top1_agreement(ref, cand)
    assert a["positions"] == 10 and a["agree"] == 9 and a["fraction"] == 0.9
    assert a["first_differences"] == [[2, 7, 99]]
    assert top1_agreement(ref, ref)["fraction"] == 1.0
    with pytest.raises(ValueError):
        top1_agreement(ref, cand[:-1])
    with pytest.raises(ValueError):
        top1_agreement([], [])


def test_prefixes_and_per_prefix_top1():
    ids = [10, 11, 12, 13]
    assert prefixes(ids) == [[10], [10, 11], [10, 11, 12]]
    assert prefixes(ids, start=2) == [[10, 11], [10, 11, 12]]
    with pytest.raises(ValueError):
        prefixes(ids, start=4)
    # an oracle that knows the text agrees everywhere
    assert per_prefix_top1(lambda p: ids[len(p)], ids) == ids[1:]


def test_hf_top1_matches_per_prefix_greedy():
    """One forward pass gives the same arg-max as one greedy step per prefix."""
    import torch

    from bench.peers.transformers import hf_top1
    from tests.helpers import tiny_hf_model

    model = tiny_hf_model()
    ids = list(range(3, 15))
    one_pass = hf_top1(model, ids)

    def greedy(prefix):
        with torch.inference_mode():
            return int(model(torch.tensor([prefix])).logits[0, -1].argmax())

    assert one_pass == per_prefix_top1(greedy, ids)


def test_engine_top1_batched_equals_one_prefix_at_a_time_and_transformers():
    """kvserve's engine, all prefixes at once, picks what it picks one prefix at a time, and
    what transformers picks (kvserve matches transformers token for token on the same weights)."""
    from bench.agreement import engine_next_token, engine_top1
    from bench.peers.transformers import hf_top1
    from tests.helpers import tiny_engine, tiny_hf_model

    hf = tiny_hf_model()
    engine = tiny_engine(hf, num_blocks=256)
    ids = [(7 * i + 3) % (hf.config.vocab_size - 3) + 3 for i in range(40)]
    batched = engine_top1(engine, ids)
    assert len(batched) == len(ids) - 1 and not engine.has_unfinished()
    assert batched == per_prefix_top1(engine_next_token(engine), ids)
    assert top1_agreement(hf_top1(hf, ids), batched)["fraction"] >= 0.95
