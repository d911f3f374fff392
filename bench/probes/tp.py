"""TP=2 vs TP=1 decode on CPU, with the communication cost shown (``python -m bench.probes.tp``).

A random Llama large enough for the split to matter (by default hidden 1024, 16 layers,
16 query / 4 KV heads, MLP 2816, vocabulary 32000; SmolLM2's 9 heads do not split in two).
Both runs use one torch thread per rank and generate the same greedy tokens for a batch of
prompts. The result: decode tokens/s, ms per decode step, and rank 0's seconds inside
collectives (step-input broadcast, all-reduces, logits all-gather) as a share of the time.
On a CPU with two cores this proves correctness and shows the overhead; it is no speed-up
claim.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cache import CacheConfig
from engine.model.arch import ModelArch
from engine.config import ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig


def synthetic(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def run(hf, tp: int, batch: int, prompt_len: int, max_tokens: int) -> dict:
    loaded = LoadedModel(path=None, name="synthetic", hf_config=hf.config, arch=ModelArch.from_hf_config(hf.config),
                         state_dict={k: v.detach().clone() for k, v in hf.state_dict().items()}, tokenizer=None)
    engine = LLMEngine(EngineConfig(model=ModelConfig(num_threads=1, tensor_parallel_size=tp, device="cpu"),
                                    cache=CacheConfig(num_blocks=256, block_size=16),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=batch)),
                       loaded)
    prompts = [[3 + (7 * i + j) % 1000 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    group = getattr(engine.runner.model.ranks, "group", None)  # rank 0 of a group: TensorParallelRanks
    comm0 = group.comm_seconds if group else 0.0
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    comm = (group.comm_seconds - comm0) if group else 0.0
    if group:
        engine.runner.model.close()
    tokens = sum(len(r.token_ids) for r in results)
    return {"tp": tp, "tokens": [r.token_ids for r in results], "seconds": elapsed,
            "decode_tok_per_s": tokens / elapsed, "ms_per_step": 1000 * elapsed / max_tokens,
            "comm_seconds_rank0": comm, "comm_share": comm / elapsed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    hf = synthetic(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
    rows = [run(hf, tp, args.batch, args.prompt_len, args.max_tokens) for tp in (1, 2)]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    for r in rows:
        print(f"TP={r['tp']}: {r['decode_tok_per_s']:.1f} decode tok/s, {r['ms_per_step']:.1f} ms/step "
              f"(batch {args.batch}), rank 0 in collectives {r['comm_seconds_rank0']:.2f}s = "
              f"{100 * r['comm_share']:.0f}% of {r['seconds']:.1f}s")
    print(f"{'PASS' if same else 'FAIL'} TP=2 greedy tokens {'equal' if same else 'differ from'} TP=1's")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
