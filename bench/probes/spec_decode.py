"""Prototype: greedy prompt-lookup (n-gram) speculative decoding on kvserve's paged model.

Not wired into the scheduler. One sequence at a time, straight on the engine's model and its
paged KV pool (slot = position, i.e. blocks 0, 1, 2, ... in order), to measure whether the
idea pays on this CPU before anyone integrates it:

1. draft: find the most recent earlier occurrence of the last ``n`` tokens (n = ngram_max
   down to ngram_min) in prompt + output so far and propose the ``k`` tokens that followed it;
2. verify: one forward pass over ``[last token, draft...]`` (a chunk with cached context, the
   same attention path as chunked prefill), logits at every row;
3. accept the longest prefix of the draft that equals the argmax at each row, plus the
   model's own token after it (so every step yields at least one token, like plain decode).
   Rejected draft tokens leave K/V in slots beyond the accepted length; the next pass
   overwrites them before anything attends to them.

Greedy output is the model's own argmax at every position; it can differ from one-token
decode only where a near-tie flips between a k+1-row matmul and a 1-row one (reported as
``token_match`` against the plain engine).

    python -m bench.probes.spec_decode                 # default model, chat prompts, k = 4
    python -m bench.probes.spec_decode --k 6 --tokens 128
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

import torch

from bench.engine_runs import kvserve_single, load_default_pair
from bench.machine import CpuMonitor, machine_info, wait_for_quiet
from bench.report import print_table, ratio, write_results
from bench.workload import chat_prompts
from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk


def propose(history: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt-lookup draft: the ``k`` tokens that followed the latest earlier match of the
    trailing n-gram (longest n first); [] when nothing matches."""
    n_hist = len(history)
    for n in range(min(ngram_max, n_hist - 1), ngram_min - 1, -1):
        tail = list(history[n_hist - n:])
        # Scan backwards for the most recent earlier occurrence (not the tail itself).
        for start in range(n_hist - n - 1, -1, -1):
            if list(history[start:start + n]) == tail:
                follow = list(history[start + n:start + n + k])
                if follow:
                    return follow
    return []


class PromptLookupDecoder:
    """Greedy single-sequence decoding with draft verification on the engine's paged model."""

    def __init__(self, engine: Any, k: int = 4, ngram_max: int = 3, ngram_min: int = 1) -> None:
        if engine.has_unfinished():
            raise RuntimeError("the prototype writes the KV pool directly; the engine must be idle")
        self.engine = engine
        self.model = engine.runner.model
        self.kv_caches = engine.runner.kv_caches
        self.block_size = engine.capacity.block_size
        self.capacity = engine.capacity.num_blocks * self.block_size
        self.k, self.ngram_max, self.ngram_min = k, ngram_max, ngram_min

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..``; return argmax token of every row."""
        n = len(tokens)
        end = start + n
        if end > self.capacity:
            raise ValueError("sequence longer than the KV pool")
        positions = torch.arange(start, end)
        blocks = torch.arange(-(-end // self.block_size))  # slot = position: blocks 0, 1, 2, ...
        if n == 1 and start > 0:  # plain decode step
            meta = AttentionMetadata(slot_mapping=positions,
                                     decode_groups=[DecodeGroup(0, 1, end, blocks, None, torch.tensor([end]))],
                                     prefills=[])
        elif start == 0:
            meta = AttentionMetadata(slot_mapping=positions, decode_groups=[],
                                     prefills=[PrefillChunk(0, n, end, None, None)])
        else:
            mask = torch.arange(end)[None, :] <= positions[:, None]
            meta = AttentionMetadata(slot_mapping=positions, decode_groups=[],
                                     prefills=[PrefillChunk(0, n, end, blocks, mask)])
        hidden = self.model(torch.tensor(list(tokens)), positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def generate(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        """Greedy ``new_tokens`` tokens (EOS not special: a throughput probe). Times exclude prefill."""
        history = list(prompt)
        first = int(self._forward(history, 0)[-1])
        out = [first]
        steps = drafted = accepted = 0
        start = time.perf_counter()
        while len(out) < new_tokens:
            pos = len(history) + len(out) - 1  # position of the last token, not yet in the cache
            room = new_tokens - len(out)
            draft = propose(history + out, min(self.k, room - 1), self.ngram_max, self.ngram_min) if room > 1 else []
            preds = self._forward([out[-1]] + draft, pos).tolist()
            n_ok = 0
            while n_ok < len(draft) and draft[n_ok] == preds[n_ok]:
                n_ok += 1
            out.extend(draft[:n_ok])
            out.append(preds[n_ok])
            steps += 1
            drafted += len(draft)
            accepted += n_ok
        elapsed = time.perf_counter() - start
        return {"tokens": out[:new_tokens], "decode_s": elapsed, "steps": steps, "drafted": drafted,
                "accepted": accepted}


def run_spec_decode(engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int = 128, k: int = 4,
                    ngram_max: int = 3, quiet_wait_s: float = 0.0, ngram_min: int = 1) -> dict[str, Any]:
    """Plain kvserve decode vs prompt-lookup decode on the same prompts (greedy, EOS ignored)."""
    from kvtypes.sampling_params import SamplingParams

    def plain(prompt: Sequence[int]) -> dict[str, Any]:
        # ignore_eos: the prototype does not stop at EOS either (nor masks it), so both sides
        # make new_tokens tokens by the same greedy rule.
        return kvserve_single(engine, prompt, new_tokens,
                              SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))

    spec = PromptLookupDecoder(engine, k, ngram_max, ngram_min)
    spec.generate(prompts[0], 8)  # warm-up
    plain(prompts[0][:8])
    runs = []
    if quiet_wait_s > 0:
        wait_for_quiet(quiet_wait_s)
    with CpuMonitor() as cpu:
        for prompt in prompts:
            engine.kv_cache.reset_prefix_cache()
            base = plain(prompt)
            engine.kv_cache.reset_prefix_cache()  # the prototype overwrites pool blocks
            fast = spec.generate(prompt, new_tokens)
            runs.append((base, fast))
    engine.kv_cache.reset_prefix_cache()
    base_tps = sum(len(b["tokens"]) - 1 for b, _ in runs) / sum(b["decode_s"] for b, _ in runs)
    spec_tps = sum(len(f["tokens"]) - 1 for _, f in runs) / sum(f["decode_s"] for _, f in runs)
    drafted = sum(f["drafted"] for _, f in runs)
    accepted = sum(f["accepted"] for _, f in runs)
    steps = sum(f["steps"] for _, f in runs)
    return {
        "benchmark": "spec_decode",
        "machine": machine_info(),
        "k": k, "ngram_max": ngram_max, "ngram_min": ngram_min, "prompts": len(prompts), "new_tokens": new_tokens,
        "plain_decode_tps": round(base_tps, 2), "spec_decode_tps": round(spec_tps, 2),
        "speedup": ratio(spec_tps, base_tps),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "tokens_per_step": round(sum(len(f["tokens"]) - 1 for _, f in runs) / steps, 3) if steps else 0.0,
        "draft_tokens_per_step": round(drafted / steps, 3) if steps else 0.0,
        "token_match": f"{sum(b['tokens'] == f['tokens'] for b, f in runs)}/{len(runs)}",
        "foreign_cpu_cores": cpu.foreign_cores,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.spec_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=3)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--quiet-wait", type=float, default=30.0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    engine, _ = load_default_pair(args.num_threads, kv_cache_gib=0.5, with_hf=False)
    prompts = chat_prompts(engine.tokenizer, args.prompts, offset=1)
    result = run_spec_decode(engine, prompts, args.tokens, args.k, args.ngram_max, args.quiet_wait, args.ngram_min)
    print_table("prompt-lookup speculative decoding (single stream, greedy)", [[
        f"k={result['k']} ngram {result['ngram_min']}..{result['ngram_max']}", result["plain_decode_tps"], result["spec_decode_tps"],
        result["speedup"], result["acceptance_rate"], result["tokens_per_step"], result["token_match"]]],
        ["config", "plain tok/s", "spec tok/s", "speedup", "accept", "tok/step", "same tokens"])
    print(f"  other processes used {result['foreign_cpu_cores']} cores meanwhile")
    print(f"  results: {write_results('spec_decode', result, args.output)}")
    return result


if __name__ == "__main__":
    main()
