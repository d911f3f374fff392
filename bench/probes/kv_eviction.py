"""KV eviction (``--kv-eviction streaming`` and ``h2o``): the quality table's rows against dense KV.

    python -m bench.probes.kv_eviction [--tokens 1000] [--window 128] [--sinks 4] [--chunk 64]
                                       [--context 1024] [--score-from 384] [--recent R] [--no-reference]

Teacher-forces the first ``--tokens`` tokens of CPython's ``pydoc_data.topics`` (prompt logprobs,
prefill chunks of ``--chunk`` tokens, as the issue's transformers reference evicts 64 at a time)
through three engines on the default model: dense KV, sinks + window, window only (0 sinks).
Prints, per policy, the mean NLL (nats/token) on positions ``--score-from`` on and its delta to
dense, the teacher-forced top-1 agreement with dense, and the KV bytes held per token of text at
the end (pool bytes per token x tokens held / tokens seen). One run, machine load hits the three
engines alike (they run one after the other, so compare the quality columns, not times).

H2O rows, at the same budget as sinks + window (``sink blocks x 16 + --window`` tokens;
``--recent`` recent tokens, default the policy's): the engine (at the defaults: the native
attention backend and decode path export per-block attention mass), then a torch reference in transformers' eager attention on
the same weights and text, chunked alike, that evicts whole 16-token blocks (what kvserve does)
and one that evicts single tokens (H2O as published): their difference is the price of block
granularity. The reference rows' deltas are against transformers' own dense run.
"""
from __future__ import annotations

import argparse

import torch

from cache import CacheConfig
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig


def text_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    return tokenizer("\n".join(topics[k] for k in sorted(topics)))["input_ids"][:n]


def run(args: argparse.Namespace, policy: str, sinks: int, ids: list[int] | None = None):
    """(per-position (logprob, top-1 id) from position 1 on, tokens held at the end, bytes per token, ids)."""
    h2o = policy == "h2o"
    config = EngineConfig(model=ModelConfig(max_model_len=args.context),
                          cache=CacheConfig(kv_cache_memory_gib=0.25, kv_eviction=policy, kv_sink_tokens=sinks,
                                            kv_window_tokens=None if h2o else args.window,
                                            kv_budget_tokens=budget(args) if h2o else None,
                                            kv_recent_tokens=args.recent if h2o else None),
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=4))
    engine = LLMEngine(config, load_model(None, torch.float32, False))
    ids = ids if ids is not None else text_tokens(engine.tokenizer, args.tokens)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    logprobs, held = None, len(ids)
    while engine.has_unfinished():
        for request in engine.scheduler.running:
            held = request.num_computed_tokens - request.num_evicted_tokens
        for out in engine.step():
            logprobs = out.prompt_logprobs or logprobs
    if policy == "none":
        held = len(ids)  # it holds every token (the loop above last saw it before its final chunk)
    return [(lp.logprob, lp.top[0][0]) for lp in logprobs], held, engine.info.kv_bytes_per_token, ids


def budget(args: argparse.Namespace) -> int:
    """H2O's budget: what sinks + window hold (the sink blocks and the window, its lower bound)."""
    return -(-args.sinks // 16) * 16 + args.window


def evict_h2o(cache, kept: list[int], mass: list[float], unit: int, sink_units: int, recent: int,
              budget_tokens: int) -> tuple[list[int], list[float]]:
    """One H2O eviction of a transformers ``DynamicCache`` in place: over ``budget_tokens``, the
    kept units of ``unit`` tokens with the least ``mass`` leave (ties: the oldest), never the first
    ``sink_units``, those holding the last ``recent`` tokens, or the last one. Returns the new
    ``kept`` (text positions, cache order) and ``mass`` (per kept unit)."""
    num_kept = -(-len(kept) // unit)
    over = num_kept - budget_tokens // unit
    if over <= 0:
        return kept, mass
    first_recent = min(num_kept - 1, max(0, len(kept) - recent) // unit)
    drop = set(sorted(range(sink_units, first_recent), key=lambda j: (mass[j], j))[:over])
    keep = [i for i in range(len(kept)) if i // unit not in drop]
    index = torch.tensor(keep)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
    return [kept[i] for i in keep], [m for j, m in enumerate(mass) if j not in drop]


@torch.inference_mode()
def reference_h2o(hf, ids: list[int], args: argparse.Namespace, unit: int | None) -> list[tuple[float, int]]:
    """Teacher-forced (logprob, top-1 id) from position 1 on, in transformers' eager attention,
    chunked as the engine runs: before each chunk, over the budget, the kept units (``unit``
    tokens: 16 = kvserve's blocks, 1 = H2O's tokens) with the least attention accumulated over
    layers, heads and query rows leave, never the sink units, the ones holding the last
    ``recent`` tokens, or the last one. ``unit`` None: dense."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kept: list[int] = []  # text positions held, in cache order
    mass: list[float] = []  # per kept unit
    recent = args.recent if args.recent is not None else \
        (budget(args) // 16 - -(-args.sinks // 16) - 1) // 2 * 16  # the policy's default
    out: list[tuple[float, int]] = []
    c = 0
    while c < len(ids):
        n = min(args.chunk, len(ids) - c)
        if unit is not None:
            kept, mass = evict_h2o(cache, kept, mass, unit, -(-args.sinks // unit), recent, budget(args))
        result = hf(input_ids=torch.tensor([ids[c:c + n]]), position_ids=torch.tensor([list(range(c, c + n))]),
                    cache_position=torch.arange(len(kept), len(kept) + n), past_key_values=cache, use_cache=True,
                    output_attentions=unit is not None)
        kept.extend(range(c, c + n))
        if unit is not None:
            per_key = sum(a[0].float().sum(dim=(0, 1)) for a in result.attentions)
            mass.extend([0.0] * (-(-len(kept) // unit) - len(mass)))
            for slot, m in enumerate(per_key.tolist()):
                mass[slot // unit] += m
        logp = torch.log_softmax(result.logits[0].float(), dim=-1)
        for i in range(n):
            if c + i + 1 < len(ids):
                out.append((float(logp[i, ids[c + i + 1]]), int(logp[i].argmax())))
        c += n
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score-from", type=int, default=384)
    p.add_argument("--recent", type=int, default=None, help="h2o: recent tokens kept (default: the policy's)")
    p.add_argument("--no-reference", action="store_true", help="skip the transformers H2O references")
    args = p.parse_args(argv)
    if args.tokens >= args.context:
        p.error("--tokens must be below --context: the dense run holds the whole text")
    dense, held, per_token, ids = run(args, "none", 0)
    scored = slice(args.score_from - 1, None)
    base = -sum(lp for lp, _ in dense[scored]) / len(dense[scored])
    print(f"text: {len(ids)} tokens of pydoc_data.topics, scored from {args.score_from}; window {args.window}, "
          f"chunk {args.chunk}, context {args.context}")
    print("| policy | NLL | delta | top-1 agreement | KV bytes/token held |")
    print("|---|---|---|---|---|")
    print(f"| dense | {base:.3f} | 0 | 1.000 | {per_token * held / len(ids):,.0f} |")
    def row(name: str, rows, ref, ref_nll: float, held: int) -> None:
        nll = -sum(lp for lp, _ in rows[scored]) / len(rows[scored])
        agree = sum(a[1] == b[1] for a, b in zip(rows[scored], ref[scored])) / len(rows[scored])
        print(f"| {name} | {nll:.3f} | {nll - ref_nll:+.3f} | {agree:.3f} | {per_token * held / len(ids):,.0f} |")

    for name, policy, sinks in ((f"streaming, {args.sinks} sinks", "streaming", args.sinks),
                                ("streaming, window only", "streaming", 0),
                                (f"h2o, budget {budget(args)}, {args.sinks} sinks (blocks)", "h2o", args.sinks)):
        rows, held, per_token, _ = run(args, policy, sinks, ids)
        row(name, rows, dense, base, held)
    if not args.no_reference:
        from transformers import AutoModelForCausalLM

        from engine.loader import resolve_model_dir

        path, _ = resolve_model_dir(None)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                  attn_implementation="eager").eval()
        ref = reference_h2o(hf, ids, args, None)
        ref_nll = -sum(lp for lp, _ in ref[scored]) / len(ref[scored])
        print(f"| transformers dense (reference) | {ref_nll:.3f} | 0 | 1.000 | {per_token:,.0f} |")
        for name, unit in (("transformers h2o, 16-token blocks", 16), ("transformers h2o, tokens", 1)):
            row(name, reference_h2o(hf, ids, args, unit), ref, ref_nll, budget(args))


if __name__ == "__main__":
    main()
