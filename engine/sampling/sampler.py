"""Token sampling: turns one engine step's logits into one token per sequence.

Per row, in order (vLLM / OpenAI semantics):

1. penalties: repetition (HF/CTRL, over prompt + output tokens), then frequency and
   presence (OpenAI, over output-token counts);
2. logit_bias: each listed token's value is added to its logit (OpenAI semantics);
3. min_tokens: stop token ids (and EOS unless ``ignore_eos``) are masked to -inf while
   fewer than ``min_tokens`` tokens have been generated;
4. grammar: a row with a structured-output grammar gets -inf on every token the grammar
   does not allow next (a token bitmask filled by the request's matcher). Should that leave
   nothing (min_tokens banned the EOS the grammar requires), the grammar wins;
5. greedy rows take the argmax; the other rows are divided by their temperature and
   truncated by top-k, then top-p (nucleus, renormalised after top-k), then min-p, and
   one token is drawn from what is left;
6. reasoning: a row whose reasoning budget is spent takes the forced closing-tag token
   (``engine/sampling/reasoning.py``), whatever was sampled; its logprob is still the raw one.
   While such a row's think block is open its grammar waits (step 4 skips it).

Logprobs are always those of the *raw* logits (log_softmax of the unmodified model
output), which is what vLLM returns by default.

Randomness: a row with a ``generator`` draws exactly one uniform number from it per
token it emits (inverse-CDF sampling; one per step, or one per token of a verified
speculative run, ``engine/sampling/verification.py``), and nothing else touches that
generator, so a seeded request yields the same tokens whatever else is in the batch and
whether it speculates or not. Rows without a generator use torch's default RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtypes.sampling_params import SamplingParams
from engine.kernels import has_op
from engine.sampling.structured_output import apply_bitmask, bitmask_words

if TYPE_CHECKING:
    from engine.sampling.reasoning import ReasoningState
    from engine.sampling.structured_output import RequestGrammar

# Top-p looks for the nucleus among the top-256 tokens, then the top-4096, and only
# then sorts the whole vocabulary: on CPU a full sort of a 49k vocabulary costs ~20x a
# top-256 and ~5x a top-4096, and nuclei are usually small.
_NUCLEUS_PROBES = (256, 4096)
# Inverse-CDF sampling works on blocks of this many tokens (see _inverse_cdf).
_CDF_BLOCK = 256


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-request generator when params.seed is set (created by the engine with
    # manual_seed(seed)), else None.
    generator: torch.Generator | None
    eos_token_ids: frozenset[int] = frozenset()  # used for min_tokens masking
    grammar: "RequestGrammar | None" = None  # resolved matcher of a structured-output request
    reasoning: "ReasoningState | None" = None  # think-block state of a budgeted or structured reasoning request

    def __post_init__(self) -> None:
        # The grammar holds this step's token only outside an open think block.
        if self.reasoning is not None and not self.reasoning.grammar_active:
            self.grammar = None


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs when any row asked for them."""

    token_ids: list[int]
    # Raw-logit logprob of each row's sampled token; filled for every row as soon as
    # one row asked, None if no row asked.
    logprobs: list[float] | None
    # Per row: top-k (token id, logprob) by descending logprob; [] for rows that asked
    # k=0 or no logprobs. None if no row asked.
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Stateless sampler; one instance serves every step."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row.

        ``logits`` is ``[len(rows), vocab]`` (the model output for each row's last
        token). It is never modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], None, None)
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(_force(_argmax(logits).tolist(), rows), None, None)

        token_ids = _sample(process_logits(logits, rows), rows)
        ids = token_ids.tolist()
        forced = _force(list(ids), rows)
        if forced != ids:
            token_ids = torch.tensor(forced, dtype=token_ids.dtype, device=token_ids.device)
        logprobs, top_logprobs = _logprobs(logits, token_ids, rows)
        return SamplerOutput(forced, logprobs, top_logprobs)


def _force(token_ids: list[int], rows: Sequence[SamplingRow]) -> list[int]:
    """``token_ids`` with each row's forced token (a spent reasoning budget's closing tag) in place
    of the sampled one; a pass over the rows that only looks at ``reasoning`` when none has one."""
    for i, row in enumerate(rows):
        if row.reasoning is not None:
            forced = row.reasoning.forced_token()
            if forced is not None:
                token_ids[i] = forced
    return token_ids


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-4 (penalties, logit_bias, min_tokens, grammar) on a float32 copy of ``logits``
    (``[len(rows), vocab]``, never modified); returns the copy."""
    work = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    apply_penalties(work, rows)
    apply_logit_bias(work, rows)
    apply_min_tokens(work, rows)
    apply_grammar(work, rows, logits)
    return work


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply repetition, then frequency and presence penalties to ``logits`` in place.

    ``logits`` must be a contiguous ``[len(rows), vocab]`` float tensor. Token ids
    outside ``[0, vocab)`` are ignored (they cannot be generated). Work is proportional
    to the number of penalised tokens, not to ``rows x vocab``.
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)

    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        idx = _flat_token_index(rows, rep_rows, vocab, with_prompt=True).to(logits.device)
        penalty = _row_values(rows, lambda p: p.repetition_penalty, logits)[idx // vocab]
        scores = flat[idx]
        # Duplicate indices read the same original score and write the same result.
        flat[idx] = torch.where(scores > 0, scores / penalty, scores * penalty)

    fp_rows = [
        i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if fp_rows:
        idx = _flat_token_index(rows, fp_rows, vocab, with_prompt=False).to(logits.device)
        idx, counts = torch.unique(idx, return_counts=True)
        owner = idx // vocab
        frequency = _row_values(rows, lambda p: p.frequency_penalty, logits)[owner]
        presence = _row_values(rows, lambda p: p.presence_penalty, logits)[owner]
        flat[idx] = flat[idx] - frequency * counts.to(logits.dtype) - presence


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Mask stop token ids (and EOS unless ``ignore_eos``) to -inf, in place, for rows
    that have generated fewer than ``min_tokens`` tokens."""
    vocab = logits.shape[1]
    idx: list[int] = []
    for i, row in enumerate(rows):
        if _min_tokens_active(row):
            banned = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned |= row.eos_token_ids
            idx.extend(i * vocab + t for t in banned if 0 <= t < vocab)
    if idx:
        logits.view(-1)[torch.tensor(idx, device=logits.device)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` values to its logits, in place (ids past the vocabulary
    are skipped; the engine refuses them at admission)."""
    vocab = logits.shape[1]
    idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token, value in (row.params.logit_bias or {}).items():
            if 0 <= token < vocab:
                idx.append(i * vocab + token)
                values.append(value)
    if idx:
        flat = logits.view(-1)
        index = torch.tensor(idx, device=logits.device)
        flat[index] = flat[index] + torch.tensor(values, dtype=logits.dtype, device=logits.device)


def apply_grammar(logits: torch.Tensor, rows: Sequence[SamplingRow], raw: torch.Tensor | None = None) -> None:
    """Mask, in place, every token the row's grammar does not allow next to -inf.

    If a row has no token left (another mask removed all the grammar allows), it is reset to
    ``raw`` (the unmodified logits) under the grammar mask alone: the grammar is the contract.
    """
    with_grammar = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not with_grammar:
        return
    vocab = logits.shape[1]
    bitmask = torch.empty(len(with_grammar), bitmask_words(vocab), dtype=torch.int32)
    for j, i in enumerate(with_grammar):
        rows[i].grammar.fill_bitmask(bitmask[j])
        opener = rows[i].reasoning.open_token if rows[i].reasoning is not None else None
        if opener is not None and opener < vocab:  # the output may open a think block first
            bitmask[j, opener // 32] |= _bit(opener % 32)
    every_row = len(with_grammar) == len(rows)
    index = torch.tensor(with_grammar, device=logits.device)
    masked = logits if every_row else logits[index]
    apply_bitmask(masked, bitmask)
    empty = torch.isneginf(masked.amax(dim=-1))
    if bool(empty.any()) and raw is not None:
        fallback = raw[index[empty]].to(logits.dtype)
        apply_bitmask(fallback, bitmask[empty.cpu()])
        masked[empty] = fallback
    if not every_row:
        logits[index] = masked


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 bitmask word, as the signed value the word holds."""
    return -(1 << 31) if i == 31 else 1 << i


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's arg-max, the first index on ties (a NaN counts as the maximum), as
    ``argmax(dim=-1)``. fp32 CPU logits go to the native ``argmax_rows`` where the kernels are
    loaded (16 x 49152 logits on 2 threads: 34 us against 155 for ``max(dim=-1).indices``, itself
    ~3x faster than ``argmax``), the rest to ``max(dim=-1).indices``: the same ids."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and has_op("argmax_rows"):
        return torch.ops.kvserve.argmax_rows(logits)
    return logits.max(dim=-1).indices


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token, exactly as a plain greedy row is sampled (speculative verification)."""
    return _argmax(logits).tolist()


def _is_plain_greedy(row: SamplingRow) -> bool:
    return row.params.is_greedy and row.params.logprobs is None and not needs_processing(row)


def needs_processing(row: SamplingRow) -> bool:
    """True when steps 1-4 may change this row's logits."""
    p = row.params
    return _has_penalties(p) or _min_tokens_active(row) or bool(p.logit_bias) or row.grammar is not None


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _min_tokens_active(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


def _row_values(
    rows: Sequence[SamplingRow], get: Callable[[SamplingParams], float], like: torch.Tensor
) -> torch.Tensor:
    return torch.tensor([get(r.params) for r in rows], dtype=like.dtype, device=like.device)


def _flat_token_index(
    rows: Sequence[SamplingRow], row_ids: list[int], vocab: int, with_prompt: bool
) -> torch.Tensor:
    """Indices ``row * vocab + token`` into the flattened logits for the tokens of
    ``row_ids`` (output tokens, plus prompt tokens if ``with_prompt``)."""
    parts = []
    for i in row_ids:
        row = rows[i]
        tokens = torch.as_tensor(row.output_token_ids, dtype=torch.long)
        if with_prompt:
            tokens = torch.cat([torch.as_tensor(row.prompt_token_ids, dtype=torch.long), tokens])
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
            tokens = tokens[(tokens >= 0) & (tokens < vocab)]
        parts.append(tokens + i * vocab)
    return torch.cat(parts)


def _take(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows ``idx`` of ``t`` (``t`` itself when ``idx`` is every row, in order)."""
    if len(idx) == t.shape[0]:
        return t
    return t[torch.tensor(idx, device=t.device)]


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token id per row from processed logits (may be modified in place)."""
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if greedy:
        tokens[greedy] = _argmax(_take(logits, greedy))
    if rand:
        tokens[rand] = _sample_random(_take(logits, rand), [rows[i] for i in rand])
    return tokens


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k / top-p / min-p truncation, then one draw per row."""
    return draw(sampling_probs(logits, rows), rows)


def sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 5 for non-greedy rows: each row's distribution (``[len(rows), vocab]``, unnormalised
    after truncation: dropped tokens are 0) from processed ``logits``, which it divides by the
    temperature in place."""
    temperature = _row_values(rows, lambda p: p.temperature, logits).unsqueeze(1)
    probs = torch.softmax(logits.div_(temperature), dim=-1)
    threshold = _truncation_threshold(probs, [r.params for r in rows])
    if threshold is not None:
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row from ``probs`` (as ``sampling_probs`` returns), consuming exactly one
    uniform of each row's generator (the module doc's contract)."""
    return _inverse_cdf(probs, _uniforms(rows, probs.device))


def _truncation_threshold(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Per-row probability below which tokens are dropped (``[rows, 1]``), or None when
    no row truncates. Top-k, top-p and min-p each keep every token at or above some
    probability, so their combination is the largest of the three thresholds; ties at
    a cut-off are kept. The most likely token always survives."""
    rows, vocab = probs.shape
    threshold = probs.new_zeros(rows, 1)
    truncates = False

    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        truncates = True

    nucleus = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if nucleus:
        idx = torch.tensor(nucleus, device=probs.device)
        cut = _top_k_top_p_threshold(_take(probs, nucleus), [params[i] for i in nucleus])
        threshold[idx] = torch.maximum(threshold[idx], cut)
        truncates = True

    return threshold if truncates else None


def _top_k_top_p_threshold(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k then top-p cut-off probability per row (``[rows, 1]``).

    Ranks only the most likely few hundred tokens first and widens the ranking (up to a
    full sort) just for the rows whose nucleus turned out to be larger.
    """
    rows, vocab = probs.shape
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    full_mass = probs.sum(dim=-1)
    cut = probs.new_zeros(rows, 1)
    pending = torch.arange(rows, device=probs.device)
    for probe in (*_NUCLEUS_PROBES, vocab):
        limited = top_k[pending][top_k[pending] < vocab]  # rows ranking fewer than all tokens
        probe = min(vocab, max(probe, int(limited.max()) if len(limited) else 0))
        sub = probs[pending] if len(pending) < rows else probs
        ranked = sub.topk(probe, dim=-1).values if probe < vocab else sub.sort(dim=-1, descending=True).values
        row_cut, resolved = _top_k_top_p_cut(ranked, top_k[pending], top_p[pending], full_mass[pending])
        cut[pending[resolved]] = row_cut[resolved]
        pending = pending[~resolved]
        if len(pending) == 0:
            break
    return cut


def _top_k_top_p_cut(
    ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, full_mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p cut-off from each row's largest probabilities ``ranked``
    (``[rows, n]``, descending; the first n of the row's vocabulary).

    A token survives top-p if the mass of the tokens ranked above it is below
    ``top_p`` times the mass left after top-k (vLLM / HF semantics). Returns the
    probability of the last surviving token (``[rows, 1]``) and whether that answer is
    exact, i.e. the cut-off falls within the ``n`` ranked tokens.
    """
    n = ranked.shape[1]
    positions = torch.arange(n, device=ranked.device)
    ranked = ranked.masked_fill(positions >= top_k.unsqueeze(1), 0.0)
    cumulative = ranked.cumsum(dim=-1)
    kept_mass = torch.where(top_k <= n, cumulative[:, -1], full_mass)
    limit = (top_p * kept_mass).unsqueeze(1)
    # Entries past top-k have zero probability, so their "mass above" equals the
    # top-k mass, which is never below the limit: they are never counted.
    survivors = ((cumulative - ranked) < limit).sum(dim=-1).clamp_(min=1)
    cut = ranked.gather(1, (survivors - 1).unsqueeze(1))
    resolved = (top_k <= n) | (cumulative[:, -1:] >= limit).squeeze(1)
    return cut, resolved


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) number per row (``[rows, 1]``, float64): from the row's own
    generator when it has one, else from torch's default RNG."""
    u = torch.empty(len(rows), 1, dtype=torch.float64, device=device)
    seeded = [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        u.uniform_()
    for i, generator in seeded:
        u[i].uniform_(generator=generator)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token index per row distributed as ``probs`` (unnormalised, >= 0, each row with
    some positive mass), driven by uniforms ``u`` (``[rows, 1]``, float64).
    Zero-probability tokens are never returned.

    Two levels: pick a block of ``_CDF_BLOCK`` tokens from the float64 CDF of block
    masses, then a token inside that block. A single float64 running sum over the whole
    vocabulary would be accurate too, but costs ~8x more on CPU (conversion + cumsum),
    and a float32 one would lose the tail tokens to rounding.
    """
    rows, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(rows, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    block, within_target = _search(block_cdf, u * block_cdf[:, -1:])
    within = blocks.gather(1, block.view(rows, 1, 1).expand(rows, 1, _CDF_BLOCK)).squeeze(1)
    offset, _ = _search(within.double().cumsum(dim=-1), within_target)
    return (block * _CDF_BLOCK + offset).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index (``[rows, 1]``) of the entry whose CDF step contains ``target``, and how far
    into that step the target lies. The target is clamped strictly below the total, and
    ``right=True`` picks the first entry whose CDF *exceeds* it, so an entry with zero
    mass (a flat step) is never chosen, even under rounding."""
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True)
    before = torch.where(index > 0, cdf.gather(1, (index - 1).clamp_(min=0)), 0.0)
    return index, target - before


def _logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """Raw-logit logprobs of the sampled tokens and of each row's top-k alternatives."""
    if all(r.params.logprobs is None for r in rows):
        return None, None
    raw = raw_logits.float()
    normaliser = torch.logsumexp(raw, dim=-1)
    sampled = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - normaliser

    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    with_top = [i for i, r in enumerate(rows) if r.params.logprobs]
    if with_top:
        k_max = min(max(rows[i].params.logprobs for i in with_top), raw.shape[1])
        values, ids = _take(raw, with_top).topk(k_max, dim=-1)
        values = values - normaliser[with_top].unsqueeze(1)
        for j, i in enumerate(with_top):
            k = rows[i].params.logprobs
            top[i] = list(zip(ids[j, :k].tolist(), values[j, :k].tolist()))
    return sampled.tolist(), top
