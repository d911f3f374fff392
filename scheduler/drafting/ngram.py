"""Prompt lookup (vLLM's ``ngram`` method): the tokens that followed the most recent earlier
occurrence of the request's longest trailing n-gram in its prompt + output."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler.drafting.base import Drafter

if TYPE_CHECKING:
    from scheduler.config import SpeculativeConfig
    from scheduler.request import Request


class NgramDrafter(Drafter):
    """Stateless: every proposal scans the request's own tokens (``propose_ngram``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, k: int) -> list[int]:
        return propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest trailing
    n-gram of ``tokens`` (``max_n`` down to ``min_n`` tokens); [] when none matches.

    One backward scan over the positions holding the last token, O(len(tokens) * max_n)."""
    n_tok = len(tokens)
    if k < 1 or n_tok < min_n + 1:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    for j in range(n_tok - 2, -1, -1):  # j: the last token of a candidate earlier occurrence
        if tokens[j] != last:
            continue
        length = 1
        limit = min(max_n, j + 1)
        while length < limit and tokens[j - length] == tokens[n_tok - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, j
            if length == max_n:
                break
    if best_len < min_n:
        return []
    return list(tokens[best_end + 1:best_end + 1 + k])
