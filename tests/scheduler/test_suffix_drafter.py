"""The suffix drafter (scheduler/drafting/suffix.py) on constructed sequences, its config keys,
and the drafter registry."""
from __future__ import annotations

import pytest

from kvtypes.sampling_params import SamplingParams
from scheduler.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from scheduler.drafting import DRAFTERS, NgramDrafter, SuffixDrafter, build_drafter
from scheduler.request import Request


def drafter(**keys) -> SuffixDrafter:
    return SuffixDrafter(SpeculativeConfig(method="suffix", **keys))


def live(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=64), max_tokens=64)


def finished(rid: str, prompt: list[int], output: list[int]) -> Request:
    request = live(rid, prompt)
    for token in output:
        request.append_output_token(token)
    return request


# "1 2 3" occurs three times before the end (each a 3-token match: what precedes differs from the
# 8 before the last one), followed by 4, 5, 4: 4 wins with 2/3; of the two "1 2 3 4", the most recent
# continues with 8 and the other with 9, a tie the most recent occurrence breaks (probability 1/3).
FREQUENT = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 8, 1, 2, 3]


@pytest.mark.parametrize("keys, k, draft", [
    ({}, 4, [4, 8, 1]),  # floor(1.0 * 3-token match) = 3 tokens at most
    ({}, 2, [4, 8]),
    ({"suffix_decoding_min_token_prob": 0.5}, 4, [4]),  # 1/3 < 0.5 stops before 8
    ({"suffix_decoding_min_token_prob": 0.0}, 4, [4, 8, 1]),
    ({"suffix_decoding_max_spec_factor": 0.5}, 4, [4]),  # floor(1.5)
    ({"suffix_decoding_max_spec_factor": 2.0}, 8, [4, 8, 1, 2, 3]),  # up to 6: the occurrence reaches the end
])
def test_most_frequent_continuation_of_the_longest_suffix(keys, k, draft):
    assert drafter(**keys).propose(live("r", FREQUENT), k) == draft


def test_the_longest_match_beats_a_more_frequent_shorter_one():
    # "7 1 2 3" (4 tokens) occurs once, followed by 5; "1 2 3" alone is followed by 4 twice.
    tokens = [7, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3, 4, 7, 1, 2, 3]
    assert drafter().propose(live("r", tokens), 4) == [5, 1, 2, 3]
    # Matches capped at 3 tokens: all three "1 2 3" tie, 4 wins 2/3, then the most recent "1 2 3 4" goes on.
    assert drafter(suffix_decoding_max_tree_depth=3).propose(live("r", tokens), 4) == [4, 7, 1]


def test_no_match_no_draft_and_the_index_follows_a_growing_request():
    d = drafter()
    r = live("r", [1, 2, 3, 4])
    assert d.propose(r, 4) == []  # the trailing bigram never occurred before
    for token in (5, 3, 4):
        r.append_output_token(token)
    assert d.propose(r, 4) == [5, 3]  # "3 4" again: a 2-token match, so 2 tokens at most
    assert d.propose(live("short", [1, 2]), 4) == []


def test_completed_outputs_are_drafted_from_across_requests_and_evicted_oldest_first():
    d = drafter(suffix_decoding_max_cached_requests=2)
    d.finish(finished("a", [50, 51], [10, 11, 12, 13, 14, 15]), completed=True)
    d.finish(finished("b", [50, 51], [20, 21, 22, 23]), completed=True)
    d.finish(finished("x", [50, 51], [30, 31, 32, 33]), completed=False)  # an abort: not a whole answer
    assert not d.live
    assert d.propose(live("c", [90, 10, 11]), 3) == [12, 13]  # "10 11" only in a's output, a 2-token match
    assert drafter().propose(live("c", [90, 10, 11]), 3) == []  # a fresh drafter has nothing cached
    assert d.propose(live("c2", [90, 30, 31]), 3) == []
    d.finish(finished("e", [50, 51], [40, 41, 42]), completed=True)  # evicts "a"
    assert d.propose(live("c3", [90, 10, 11]), 3) == []
    assert d.propose(live("c4", [90, 20, 21]), 3) == [22, 23]
    off = drafter(suffix_decoding_max_cached_requests=0)
    off.finish(finished("a", [50, 51], [10, 11, 12, 13]), completed=True)
    assert off.propose(live("c", [90, 10, 11]), 3) == []


def test_the_request_itself_wins_a_tie_with_the_cache_by_recency():
    d = drafter()
    d.finish(finished("a", [0, 0], [5, 6, 9]), completed=True)
    assert d.propose(live("r", [5, 6, 7, 1, 5, 6]), 1) == [7]  # own 7 (1/2 each): own occurrences come first


# ---- config and registry ------------------------------------------------------------------------
def test_registry_has_a_drafter_per_method():
    assert tuple(DRAFTERS) == SPECULATIVE_METHODS
    assert isinstance(build_drafter(SpeculativeConfig()), NgramDrafter)
    assert isinstance(build_drafter(SpeculativeConfig(method="suffix")), SuffixDrafter)


def test_suffix_config_in_vllms_shape():
    cfg = SchedulerConfig(speculative_config='{"method": "suffix", "num_speculative_tokens": 8, '
                                             '"suffix_decoding_max_tree_depth": 16, '
                                             '"suffix_decoding_max_cached_requests": 0, '
                                             '"suffix_decoding_max_spec_factor": 2.5, '
                                             '"suffix_decoding_min_token_prob": 0.2}').speculative_config
    assert (cfg.method, cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth) == ("suffix", 8, 16)
    assert (cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor,
            cfg.suffix_decoding_min_token_prob) == (0, 2.5, 0.2)


@pytest.mark.parametrize("value, message", [
    ('{"method": "suffix", "prompt_lookup_max": 4}', "prompt_lookup_max applies to method ngram, not suffix"),
    ('{"method": "ngram", "suffix_decoding_max_tree_depth": 4}',
     "suffix_decoding_max_tree_depth applies to method suffix, not ngram"),
    ('{"method": "suffix", "suffix_decoding_corpus_tokens": 1000}', "unknown key(s) in speculative_config: "
                                                                    "suffix_decoding_corpus_tokens"),
    ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}', "max_tree_depth must be an integer >= 2"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "max_cached_requests must be an integer >= 0"),
    ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "max_spec_factor must be a number > 0"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob must be a number in [0, 1]"),
])
def test_suffix_config_rejects_bad_values(value, message):
    with pytest.raises(ValueError) as info:
        SchedulerConfig(speculative_config=value)
    assert message in str(info.value)
