"""Speculative decoding (n-gram prompt lookup or suffix decoding, in the scheduler) against plain
decode, single stream or ``--streams`` concurrent ones.

Each prompt runs greedy through ``LLMEngine.step()`` twice on the same engine, speculation off
then on (``scheduler.speculative_config`` switched between the runs, the prefix cache reset
before each), and reports decode tok/s (after the first token), the acceptance rate (accepted
draft tokens / draft tokens), tokens per step and whether both runs gave the same tokens.
Prompt classes: ``copy`` (outputs that copy from the context: repeat a passage with one edit,
quote a document, edit a function) and ``chat`` (ordinary questions). With ``--streams N`` each
class runs N requests at once (its prompts repeated), plain then speculative, through
``LLMEngine.generate``; tok/s is then all output tokens over the whole run, prefill included.

    python -m bench.probes.spec_decode                 # default model, k = 4, ngram 1..3
    python -m bench.probes.spec_decode --k 6 --tokens 128 --classes copy
    python -m bench.probes.spec_decode --streams 16 --method suffix
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Sequence

from bench.engine_runs import kvserve_single, load_default_pair
from bench.machine import CpuMonitor, machine_info, wait_for_quiet
from bench.report import print_table, ratio, write_results
from bench.workload import chat_prompts

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick and polished the great lens until it shone. Ships passing the rocky point "
           "counted on his light, and in forty years it never once failed them. When the storm of 1911 "
           "tore the roof from the keeper's cottage, he stayed in the tower all night and kept the lamp lit.")
FUNCTION = '''def moving_average(values, window):
    """Return the moving averages of values over window items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
COPY_TASKS = [
    f"Repeat the following paragraph exactly, but write 'lantern' instead of 'lamp':\n\n{PASSAGE}",
    f"Document:\n\n{PASSAGE}\n\nQuote the sentence of the document that mentions the storm, word for word, "
    "then quote the sentence about the ships.",
    f"Rename the function below to rolling_mean and return the whole function:\n\n{FUNCTION}",
]


def copy_prompts(tokenizer: Any, vocab_size: int, n: int) -> list[list[int]]:
    """Prompts whose answers copy from the context (random repeated ids without a tokenizer)."""
    if tokenizer is None:
        import random

        rng = random.Random(1)
        passage = [rng.randrange(3, vocab_size) for _ in range(24)]
        return [passage * 3 for _ in range(n)]
    from engine.tokenizer import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)]}]) for i in range(n)]


def run_spec_decode(engine: Any, prompt_sets: dict[str, Sequence[Sequence[int]]], new_tokens: int = 128,
                    k: int = 4, ngram_min: int = 1, ngram_max: int = 3, quiet_wait_s: float = 0.0,
                    verify_cost_ratio: float | None = None, method: str = "ngram",
                    streams: int = 1, rounds: int = 1) -> dict[str, Any]:
    """Plain and speculative decode of every prompt, by class (greedy, EOS ends a run).
    ``verify_cost_ratio``: the adaptive rule's (None: the config default; 0: verify every draft).
    ``streams`` > 1: each class as one batch of that many concurrent requests. ``rounds`` > 1:
    each class measured that many times (plain and speculative side by side in each round), the
    round of the median speedup reported, with every round's speedup beside it."""
    from kvtypes.sampling_params import SamplingParams
    from scheduler.config import SpeculativeConfig

    config = engine.scheduler.config
    spec = (SpeculativeConfig("ngram", k, ngram_min, ngram_max) if method == "ngram"
            else SpeculativeConfig(method, num_speculative_tokens=k))
    if verify_cost_ratio is not None:
        spec = dataclasses.replace(spec, verify_cost_ratio=verify_cost_ratio)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    stats = engine.scheduler.stats

    def one(prompt: Sequence[int], speculative: bool) -> dict[str, Any]:
        config.speculative_config = spec if speculative else None
        engine.kv_cache.reset_prefix_cache()
        drafted, accepted, drafts = stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_num_drafts
        run = kvserve_single(engine, prompt, new_tokens, params)
        run.update(drafted=stats.spec_draft_tokens - drafted, accepted=stats.spec_accepted_tokens - accepted,
                   drafts=stats.spec_num_drafts - drafts)
        return run

    def batch(prompts: Sequence[Sequence[int]], speculative: bool) -> dict[str, Any]:
        config.speculative_config = spec if speculative else None
        engine.kv_cache.reset_prefix_cache()
        drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
        start = time.perf_counter()
        results = engine.generate([list(p) for p in prompts], params)
        return {"tokens": [r.token_ids for r in results], "elapsed_s": time.perf_counter() - start,
                "drafted": stats.spec_draft_tokens - drafted, "accepted": stats.spec_accepted_tokens - accepted}

    first = next(iter(prompt_sets.values()))[0]
    one(first[:8], False)  # warm-up: kernels, both paths
    one(first[:8], True)
    if quiet_wait_s > 0:
        wait_for_quiet(quiet_wait_s)
    classes = {}
    try:
        with CpuMonitor() as cpu:
            for name, prompts in prompt_sets.items():
                measured = []
                for _ in range(rounds):
                    # a new config object per round builds a new drafter: the suffix method's
                    # cache of completed outputs would otherwise draft round 2 from round 1's answers
                    spec = dataclasses.replace(spec)
                    if streams > 1:
                        measured.append(_concurrent_class(batch, [prompts[i % len(prompts)] for i in range(streams)]))
                    else:
                        measured.append(_single_class(one, prompts))
                classes[name] = _median_round(measured)
    finally:
        config.speculative_config = None
        engine.kv_cache.reset_prefix_cache()
    return {"benchmark": "spec_decode", "machine": machine_info(), "method": method, "streams": streams, "k": k,
            "ngram_min": ngram_min, "ngram_max": ngram_max, "new_tokens": new_tokens, "rounds": rounds,
            "classes": classes, "foreign_cpu_cores": cpu.foreign_cores}


def _median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose speedup is the median (the lower one of an even count), with every round's."""
    ordered = sorted(results, key=lambda c: c["speedup"] if c["speedup"] is not None else 0.0)
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    if len(results) > 1:
        chosen["round_speedups"] = [c["speedup"] for c in results]
    return chosen


def _single_class(one: Any, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One class one prompt at a time, each plain then speculative; tok/s over decode time."""
    runs = [(one(p, False), one(p, True)) for p in prompts]
    base_tok = sum(len(b["tokens"]) - 1 for b, _ in runs)
    spec_tok = sum(len(s["tokens"]) - 1 for _, s in runs)
    base_tps = base_tok / max(sum(b["decode_s"] for b, _ in runs), 1e-9)
    spec_tps = spec_tok / max(sum(s["decode_s"] for _, s in runs), 1e-9)
    drafted = sum(s["drafted"] for _, s in runs)
    accepted = sum(s["accepted"] for _, s in runs)
    return {
        "prompts": len(prompts), "output_tokens": spec_tok + len(runs),
        "plain_decode_tps": round(base_tps, 2), "spec_decode_tps": round(spec_tps, 2),
        "speedup": ratio(spec_tps, base_tps),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "draft_tokens": drafted, "accepted_tokens": accepted,
        # a step with a draft yields accepted + 1 tokens; one without yields 1
        "tokens_per_step": round(spec_tok / max(spec_tok - accepted, 1), 3),
        "token_match": f"{sum(b['tokens'] == s['tokens'] for b, s in runs)}/{len(runs)}",
    }


def _concurrent_class(batch: Any, prompts: list[Sequence[int]]) -> dict[str, Any]:
    """One class as one concurrent batch, plain then speculative; tok/s over the whole run."""
    base, spec = batch(prompts, False), batch(prompts, True)
    base_tok, spec_tok = sum(map(len, base["tokens"])), sum(map(len, spec["tokens"]))
    base_tps, spec_tps = base_tok / max(base["elapsed_s"], 1e-9), spec_tok / max(spec["elapsed_s"], 1e-9)
    return {"prompts": len(prompts), "output_tokens": spec_tok, "plain_decode_tps": round(base_tps, 2),
            "spec_decode_tps": round(spec_tps, 2), "speedup": ratio(spec_tps, base_tps),
            "acceptance_rate": round(spec["accepted"] / spec["drafted"], 3) if spec["drafted"] else 0.0,
            "draft_tokens": spec["drafted"], "accepted_tokens": spec["accepted"],
            "tokens_per_step": round(spec_tok / max(spec_tok - spec["accepted"], 1), 3),
            "token_match": f"{sum(a == b for a, b in zip(base['tokens'], spec['tokens']))}/{len(prompts)}"}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.spec_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per class")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--classes", default="copy,chat")
    parser.add_argument("--quiet-wait", type=float, default=30.0)
    parser.add_argument("--verify-cost-ratio", type=float, default=None,
                        help="the adaptive rule's cost ratio (default: the config's; 0 verifies every draft)")
    parser.add_argument("--method", choices=["ngram", "suffix"], default="ngram")
    parser.add_argument("--streams", type=int, default=1, help="concurrent requests per class (1: one at a time)")
    parser.add_argument("--rounds", type=int, default=1, help="measure each class this many times; report the median")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    engine, _ = load_default_pair(args.num_threads, kv_cache_gib=0.5, with_hf=False)
    sets = {"copy": copy_prompts(engine.tokenizer, engine.arch.vocab_size, args.prompts),
            "chat": chat_prompts(engine.tokenizer, args.prompts, offset=1)}
    sets = {name: sets[name] for name in args.classes.split(",")}
    result = run_spec_decode(engine, sets, args.tokens, args.k, args.ngram_min, args.ngram_max, args.quiet_wait,
                             args.verify_cost_ratio, args.method, args.streams, args.rounds)
    shape = "single stream" if args.streams == 1 else f"{args.streams} streams"
    lookup = f", ngram {args.ngram_min}..{args.ngram_max}" if args.method == "ngram" else ""
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    title = f"{args.method} speculative decoding, {shape}, greedy (k={args.k}{lookup}){rounds}"
    print_table(title,
                [[name, c["plain_decode_tps"], c["spec_decode_tps"], c["speedup"], c["acceptance_rate"],
                  c["tokens_per_step"], c["token_match"]] for name, c in result["classes"].items()],
                ["prompts", "plain tok/s", "spec tok/s", "speedup", "accept", "tok/step", "same tokens"])
    print(f"  other processes used {result['foreign_cpu_cores']} cores meanwhile")
    print(f"  results: {write_results('spec_decode', result, args.output)}")
    return result


if __name__ == "__main__":
    main()
