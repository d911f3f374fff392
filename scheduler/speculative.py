"""Draft-free speculative decoding's token logic: who may speculate, the n-gram (prompt-lookup)
draft, and greedy acceptance. Pure functions over token lists; the scheduler calls them.

Exactness: a request speculates only when its next tokens are each row's plain argmax (greedy,
no logprobs, penalties, logit bias, active min_tokens or grammar), so accepting the longest
draft prefix that equals the model's argmax at each verified position, plus the model's own
token after it, yields exactly the tokens plain decode would (up to float summation order).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request


def can_speculate(request: Request) -> bool:
    """True when greedy verification reproduces plain decode for this request's next tokens."""
    p = request.sampling_params
    return (p.is_greedy and p.logprobs is None and not p.logit_bias and request.grammar is None
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and request.num_output_tokens >= p.min_tokens)


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


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The accepted run: the longest prefix of ``draft`` equal to ``targets`` (the model's argmax
    after the last known token and after each draft token: ``len(draft) + 1`` of them), then the
    model's token at the first mismatch (the bonus token when the whole draft matched)."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} targets, got {len(targets)}")
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return list(targets[:n + 1])
