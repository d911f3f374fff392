"""Speculative verification: from the target model's logits at every position of a draft-carrying
row, the run the row emits: the accepted draft tokens, then the one token the model chose after
them (at the first rejected position, or the bonus token after a fully accepted draft).

The target distribution p_i at position i (after the request's last known token and draft[:i])
is exactly the sampler's for a plain row whose output is the request's output followed by
draft[:i]: the same penalties, logit_bias, min_tokens, temperature and top-k / top-p / min-p
(``engine/sampling/sampler.py``, steps 1-3 and 5). Grammars are not verified here (the matcher
would have to walk the draft and back); logprobs of a multi-token run are not returned.

- Greedy rows accept draft[i] while it equals argmax p_i and emit the argmax at the first
  mismatch: the tokens plain greedy decode yields, up to float summation order.
- Rows with temperature > 0: a draft-free drafter's proposal is deterministic, so its q_i is a
  point mass on draft[i], and standard speculative sampling (accept x with probability
  min(1, p(x) / q(x)) = p(x); on rejection draw from max(p - q, 0) renormalised, which is p with x
  removed, renormalised; after k acceptances the bonus from p_k) is realised as: draw t_i from p_i
  with the row's next uniform (the sampler's inverse CDF), accept while t_i == draft[i], emit t_i
  at the first mismatch. P(t_i = x) = p(x) is the acceptance probability, and t_i given t_i != x
  is distributed as p without x renormalised: the residual. So every emitted token is distributed
  as plain sampling's, and it consumes exactly one uniform, the one plain decode would have drawn
  for that output position: a seeded request emits the same tokens with or without speculation
  (up to float summation order), whatever else runs in the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.sampling.sampler import (SamplingRow, draw, greedy_token_ids, needs_processing, process_logits,
                                     sampling_probs)


def verify_drafts(logits: torch.Tensor, rows: Sequence[SamplingRow],
                  drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each row's emitted run (``1 .. len(draft) + 1`` tokens, all but the last equal to the
    draft's prefix); ``len(run) - 1`` draft tokens were accepted.

    ``logits`` is ``[sum(len(d) + 1 for d in drafts), vocab]``: row r's ``len(drafts[r]) + 1``
    positions one after another, position i being the model's output after the row's last known
    token and ``drafts[r][:i]``. ``rows`` describe each request before this step. Never modifies
    ``logits``; a row with a grammar is an error (the scheduler does not draft for one).
    """
    sizes = [len(d) + 1 for d in drafts]
    if len(rows) != len(drafts) or logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(f"{len(rows)} rows with drafts of {[s - 1 for s in sizes]} tokens need "
                         f"[{sum(sizes)}, vocab] logits, got {tuple(logits.shape)}")
    if any(row.grammar is not None for row in rows):
        raise ValueError("drafts of a row with a grammar cannot be verified")
    positions = [_at_position(row, draft, i) for row, draft in zip(rows, drafts) for i in range(len(draft) + 1)]
    first = [sum(sizes[:r]) for r in range(len(rows))]
    if not any(needs_processing(p) for p in positions) and all(row.params.is_greedy for row in rows):
        return _accept_greedy(greedy_token_ids(logits), drafts, first)
    work = process_logits(logits, positions)
    greedy = [r for r, row in enumerate(rows) if row.params.is_greedy]
    runs: list[list[int]] = [[] for _ in rows]
    if greedy:
        index = [first[r] + i for r in greedy for i in range(sizes[r])]
        targets = greedy_token_ids(work[torch.tensor(index)])
        starts = [sum(sizes[g] for g in greedy[:j]) for j in range(len(greedy))]
        for r, run in zip(greedy, _accept_greedy(targets, [drafts[r] for r in greedy], starts)):
            runs[r] = run
    sampled = [r for r, row in enumerate(rows) if not row.params.is_greedy]
    if sampled:
        index = [first[r] + i for r in sampled for i in range(sizes[r])]
        probs = sampling_probs(work[torch.tensor(index)], [positions[i] for i in index])
        starts = [sum(sizes[s] for s in sampled[:j]) for j in range(len(sampled))]
        for r, run in zip(sampled, _accept_sampled(probs, [rows[r] for r in sampled],
                                                   [drafts[r] for r in sampled], starts)):
            runs[r] = run
    return runs


def _at_position(row: SamplingRow, draft: Sequence[int], i: int) -> SamplingRow:
    """The row as the sampler sees it at draft position ``i``: draft[:i] already generated (read by
    penalties and min_tokens; a row that steps 1-4 leave alone is shared as it is)."""
    if i == 0 or not needs_processing(row):
        return row
    return replace(row, output_token_ids=[*row.output_token_ids, *draft[:i]])


def _accept_greedy(targets: list[int], drafts: Sequence[Sequence[int]], starts: list[int]) -> list[list[int]]:
    """Per row: the longest draft prefix equal to the argmaxes, then the argmax after it."""
    runs = []
    for draft, start in zip(drafts, starts):
        n = 0
        while n < len(draft) and draft[n] == targets[start + n]:
            n += 1
        runs.append(targets[start:start + n + 1])
    return runs


def _accept_sampled(probs: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]],
                    starts: list[int]) -> list[list[int]]:
    """Per row: draw at each position in turn with the row's next uniform, stop after the first
    draw that differs from the draft (or after the bonus position). One batched draw per position."""
    runs: list[list[int]] = [[] for _ in rows]
    alive = list(range(len(rows)))
    i = 0
    while alive:
        tokens = draw(probs[torch.tensor([starts[r] + i for r in alive])], [rows[r] for r in alive]).tolist()
        still = []
        for r, token in zip(alive, tokens):
            runs[r].append(token)
            if i < len(drafts[r]) and token == drafts[r][i]:
                still.append(r)
        alive, i = still, i + 1
    return runs
