"""Teacher-forced top-1 agreement: do two implementations pick the same next token at every
position of a fixed text?

Greedy text equality is the wrong sanity check between a quantized-activation peer and
kvserve: one near-tie early on (llama.cpp quantizes activations to 8 bits for its Q4_1 dot
products) sends the two texts apart for good, although both models are fine. Teacher forcing
feeds every side the same tokens and compares only the arg-max after each prefix, so one
near-tie costs one position, not the rest of the text.

Each side gives a list ``top1[i]`` = its arg-max next token after ``ids[:start + i + 1]``:

* transformers: one forward pass over the text (the oracle, fp32; ``bench.peers.transformers.hf_top1``);
* kvserve's engine in process: one greedy token per prefix, all prefixes submitted at once
  (``engine_top1``, here);
* llama-server: one greedy token per prefix, one request after the other (prompt caching makes
  each a one-token extension), through its native ``/completion`` (``return_tokens`` gives the
  id; its OpenAI routes have no prompt logprobs / ``echo``; ``bench.peers.llama_server``);
* node-llama-cpp: one greedy token per prefix (the ``peers`` scenario).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

# Plain English prose, no chat template: every position is a natural next-token prediction.
AGREEMENT_TEXT = (
    "The river rises in the hills to the north of the town and runs south through a wide valley of farms "
    "and orchards before it reaches the sea. In the spring, when the snow melts, the water climbs almost to "
    "the top of the old stone bridge, and the children of the village walk down after school to watch it. "
    "Most years the bridge holds, but the older people still remember the flood that carried away the mill, "
    "the bakery and half of the market square. After that the town built a wall along the bank, planted "
    "willows to hold the soil, and moved the market to the hill behind the church, where it is held every "
    "Saturday morning to this day."
)
AGREEMENT_TARGET = 0.95


def top1_agreement(reference: Sequence[int], candidate: Sequence[int], max_listed: int = 5) -> dict[str, Any]:
    """Share of positions where ``candidate``'s top-1 equals ``reference``'s (same length)."""
    if len(reference) != len(candidate):
        raise ValueError(f"position counts differ: {len(reference)} vs {len(candidate)}")
    if not reference:
        raise ValueError("no positions to compare")
    differ = [i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b]
    return {"positions": len(reference), "agree": len(reference) - len(differ),
            "fraction": round((len(reference) - len(differ)) / len(reference), 4),
            "first_differences": [[i, int(reference[i]), int(candidate[i])] for i in differ[:max_listed]]}


def prefixes(ids: Sequence[int], start: int = 1) -> list[list[int]]:
    """``ids[:start]``, ``ids[:start + 1]``, ..., ``ids[:-1]``: the prompts whose next token is known."""
    if not 1 <= start < len(ids):
        raise ValueError(f"start {start} outside 1..{len(ids) - 1}")
    return [list(ids[:n]) for n in range(start, len(ids))]


def per_prefix_top1(next_token: Callable[[list[int]], int], ids: Sequence[int], start: int = 1) -> list[int]:
    """``next_token(prefix)`` for every prefix of ``ids`` from length ``start``."""
    return [int(next_token(p)) for p in prefixes(ids, start)]


def engine_top1(engine: Any, ids: Sequence[int], start: int = 1) -> list[int]:
    """kvserve's engine in process: one greedy token after every prefix, all prefixes submitted
    at once (the scheduler batches them; the prefix cache shares their common blocks)."""
    from kvtypes.sampling_params import SamplingParams

    order = [engine.add_request(p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
             for p in prefixes(ids, start)]
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = int(o.new_token_ids[0])
    return [first[r] for r in order]


def engine_next_token(engine: Any) -> Callable[[list[int]], int]:
    """kvserve's engine in process: one greedy token (EOS allowed) per call."""
    from kvtypes.sampling_params import SamplingParams

    def next_token(prefix: list[int]) -> int:
        engine.add_request(prefix, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                out.extend(o.new_token_ids)
        return out[0]

    return next_token


