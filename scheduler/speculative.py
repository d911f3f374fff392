"""Draft-free speculative decoding's token logic: who may speculate, the shape of a verified run,
and the adaptive rule that decides per step who drafts. Pure functions
over token lists and estimates; the scheduler calls them.

Exactness: the engine verifies a draft (engine/sampling/verification.py: greedy acceptance, or
rejection sampling for temperature > 0) so that the run it emits is distributed as plain decode's
tokens (greedy: the same tokens, up to float summation order); the scheduler appends that run and
rolls the rejected slots back. Requests under a grammar or asking for logprobs do not speculate.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.config import SpeculativeConfig
    from scheduler.request import Request

# Weight of one observed draft position in a request's acceptance estimate (``Request.spec_acceptance``,
# which starts at 0.5): about the last 4 observations dominate, so a request that starts or stops
# copying from its context is followed within a few tokens.
ACCEPTANCE_WEIGHT = 0.25


def can_speculate(request: Request) -> bool:
    """True when verification reproduces plain decode's distribution for this request's next tokens
    (engine/sampling/verification.py): not under a grammar (its matcher would have to walk the
    draft and back), without logprobs (a multi-token run carries no per-token logprobs) and outside
    a budgeted or structured think block (its state advances one token at a time)."""
    return request.sampling_params.logprobs is None and request.grammar is None and request.reasoning is None


def check_run(draft: Sequence[int], run: Sequence[int]) -> None:
    """Raise unless ``run`` is what a verification of ``draft`` may emit: the accepted draft prefix,
    then one token of the model's (1 .. ``len(draft) + 1`` tokens)."""
    if not 1 <= len(run) <= len(draft) + 1 or list(run[:-1]) != list(draft[:len(run) - 1]):
        raise ValueError(f"run {list(run)} does not continue an accepted prefix of draft {list(draft)}")


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of ``k`` draft tokens yields on average when each draft position is
    accepted with probability ``acceptance`` given the ones before it: 1 + p + p^2 + ... + p^k
    (the model's own token always comes)."""
    return sum(acceptance ** i for i in range(k + 1))


def observe_acceptance(estimate: float, num_accepted: int, num_drafted: int) -> float:
    """``estimate`` updated with what one verification showed: ``num_accepted`` accepted positions,
    then one rejected position when ``num_accepted < num_drafted`` (positions after the first
    rejection were not observed)."""
    outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafted else [])
    for outcome in outcomes:
        estimate += ACCEPTANCE_WEIGHT * (outcome - estimate)
    return estimate


def choose_speculators(candidates: Sequence[tuple[Request, int]], num_decoding: int,
                       config: SpeculativeConfig, row_budget: int | None = None) -> set[str]:
    """The ids of the candidates (decoding requests that have a draft, with its length) that verify
    their draft this step; the others decode one token.

    Costs are in plain decode steps of this batch: a step that verifies any draft costs
    ``verify_cost_ratio`` (r) of them, whoever else runs in it. So drafting pays only when the
    extra tokens it is expected to bring exceed what the slower step costs every decoding row:

    - nobody drafts when more than ``disable_by_batch_size`` requests decode;
    - a candidate drafts only if alone it would pay: ``expected_tokens(p, k) > r``;
    - with ``row_budget`` (the rows the engine's fast path takes in one step, the native decode
      path's ``max_rows``; r was measured on it) and r > 1, the step's rows (one per decoding
      request plus every draft token) stay within it: the candidates that bring most go first, a
      draft that does not fit stays out;
    - and those together must pay for the batch: sum of ``expected_tokens(p, k) - 1`` over them
      > (r - 1) * ``num_decoding``; else nobody drafts.

    With r <= 1 every candidate drafts (the verify step costs no more than a plain one, wherever
    it runs).
    """
    cutoff = config.disable_by_batch_size
    if not candidates or (cutoff is not None and num_decoding > cutoff):
        return set()
    r = config.verify_cost_ratio
    ranked = sorted(((expected_tokens(request.spec_acceptance, k) - 1.0, request.request_id, k)
                     for request, k in candidates), key=lambda c: -c[0])
    chosen: dict[str, float] = {}
    rows, limit = num_decoding, row_budget if r > 1.0 else None
    for gain, rid, k in ranked:
        if gain + 1.0 > r and (limit is None or rows + k <= limit):
            chosen[rid] = gain
            rows += k
    if r > 1.0 and sum(chosen.values()) <= (r - 1.0) * num_decoding:
        return set()
    return set(chosen)
