"""Suffix decoding (vLLM's ``suffix`` method, after SuffixDecoding, arXiv 2411.04975): the request's
tokens so far are matched by their longest suffix (2 to ``suffix_decoding_max_tree_depth`` tokens)
against its own prompt + output and the outputs of recently completed requests, and the draft
follows the most frequent continuation of that suffix's occurrences.

Structure: a position index in place of a suffix tree. Each sequence (a live request's prompt +
output, a cached output) is indexed by bigram: (a, b) -> the positions of b. The occurrences of the
trailing bigram are examined (the ``MAX_CANDIDATES`` most recent per source), each extended
backwards to its match length; those of the longest match are the occurrences of the longest
matching suffix, i.e. the suffix tree's node for it. Walking that node's children by highest count
is then: count the tokens that follow the occurrences, take the most frequent (ties: the most
recent occurrence's), keep the occurrences it continues, repeat.

A draft stops at ``k`` tokens (``num_speculative_tokens``, or less when the request's room is
less), at ``floor(suffix_decoding_max_spec_factor * match length)`` tokens (a short match
speculates little), and before a token whose estimated probability, the product along the path of
count(token) / count(occurrences), falls below ``suffix_decoding_min_token_prob``.

Cross-request reuse: a request that completes (stop or length) leaves its output in a cache of the
``suffix_decoding_max_cached_requests`` most recent outputs (0: none), oldest evicted first, so an
agent loop or a repeated rollout drafts from what the previous turns produced.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from scheduler.drafting.base import Drafter

if TYPE_CHECKING:
    from scheduler.config import SpeculativeConfig
    from scheduler.request import Request

# Occurrences of the trailing bigram examined per source (the request itself, the cache), most
# recent first: bounds a proposal's work on a bigram that occurs everywhere.
MAX_CANDIDATES = 64


class SuffixIndex:
    """Bigram positions over sequences: (a, b) -> {sequence id: positions of b, ascending}.

    A sequence may grow (a live request's ``all_token_ids``): ``extend`` indexes what was
    appended since. ``remove`` drops a sequence and every position of it."""

    def __init__(self) -> None:
        self.sequences: dict[int | str, Sequence[int]] = {}
        self._indexed: dict[int | str, int] = {}
        self._positions: dict[tuple[int, int], dict[int | str, list[int]]] = {}

    def add(self, key: int | str, tokens: Sequence[int]) -> None:
        self.sequences[key] = tokens
        self._indexed[key] = 1
        self.extend(key)

    def extend(self, key: int | str) -> None:
        tokens = self.sequences[key]
        for p in range(self._indexed[key], len(tokens)):
            self._positions.setdefault((tokens[p - 1], tokens[p]), {}).setdefault(key, []).append(p)
        self._indexed[key] = max(1, len(tokens))

    def remove(self, key: int | str) -> None:
        tokens = self.sequences.pop(key)
        del self._indexed[key]
        for p in range(1, len(tokens)):
            bigram = (tokens[p - 1], tokens[p])
            entry = self._positions.get(bigram)
            if entry is not None:
                entry.pop(key, None)
                if not entry:
                    del self._positions[bigram]

    def recent(self, bigram: tuple[int, int], limit: int,
               below: int | None = None) -> Iterator[tuple[Sequence[int], int]]:
        """Up to ``limit`` (sequence, position of the bigram's second token) pairs, newest sequence
        and position first; ``below``: only positions before it."""
        entry = self._positions.get(bigram, {})
        for key in reversed(entry):
            tokens = self.sequences[key]
            for p in reversed(entry[key]):
                if below is not None and p >= below:
                    continue
                yield tokens, p
                limit -= 1
                if limit == 0:
                    return

    def __len__(self) -> int:
        return len(self.sequences)


class SuffixDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.live: dict[str, SuffixIndex] = {}  # request id -> the index of its own tokens
        self.cache = SuffixIndex()  # completed requests' outputs, oldest first
        self._next_cached = 0

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = request.all_token_ids
        n = len(tokens)
        if k < 1 or n < 3:
            return []
        own = self.live.get(request.request_id)
        if own is None:
            own = self.live[request.request_id] = SuffixIndex()
            own.add(request.request_id, tokens)
        else:
            own.extend(request.request_id)
        bigram = (tokens[-2], tokens[-1])
        candidates = [*own.recent(bigram, MAX_CANDIDATES, below=n - 1), *self.cache.recent(bigram, MAX_CANDIDATES)]
        if not candidates:
            return []
        lengths = [self._match_length(tokens, seq, p) for seq, p in candidates]
        longest = max(lengths)
        occurrences = [c for c, length in zip(candidates, lengths) if length == longest]
        return self._walk(occurrences, min(k, int(self.max_spec_factor * longest)))

    def _match_length(self, tokens: Sequence[int], seq: Sequence[int], p: int) -> int:
        """How many tokens before and at ``seq[p]`` equal the end of ``tokens`` (2 known to match)."""
        n, length = len(tokens), 2
        while length < min(self.max_depth, n - 1) and length <= p and seq[p - length] == tokens[n - 1 - length]:
            length += 1
        return length

    def _walk(self, occurrences: list[tuple[Sequence[int], int]], limit: int) -> list[int]:
        draft: list[int] = []
        prob = 1.0
        while len(draft) < limit:
            followers = [(seq, p) for seq, p in occurrences if p + 1 < len(seq)]
            if not followers:
                break
            counts = Counter(seq[p + 1] for seq, p in followers)  # insertion order: most recent first
            token = max(counts, key=counts.__getitem__)
            prob *= counts[token] / len(followers)
            if prob < self.min_token_prob:
                break
            draft.append(token)
            occurrences = [(seq, p + 1) for seq, p in followers if seq[p + 1] == token]
        return draft

    def finish(self, request: Request, completed: bool) -> None:
        self.live.pop(request.request_id, None)
        if not completed or self.max_cached == 0 or request.num_output_tokens < 2:
            return
        self.cache.add(self._next_cached, list(request.output_token_ids))
        self._next_cached += 1
        while len(self.cache) > self.max_cached:
            self.cache.remove(next(iter(self.cache.sequences)))
