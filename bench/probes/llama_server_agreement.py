"""llama-server's own teacher-forced agreement and NLL delta against fp32 transformers, over the
text and positions the CPU defaults' numbers use (docs/configuration.md: the first 2,000 tokens of
``bench/probes/fixed_text.txt`` repeated, as ``tests/engine/model/test_default_numerics.py``).

    python -m bench.probes.llama_server_agreement [--gguf Q4_K_M|Q8_0|f32|PATH] [--tokens 2000]
                                                  [--top-k 1000] [--num-threads N]

The reference: transformers' fp32 log-probabilities of every next token (one forward pass on the
default model's dense weights). llama-server (one slot, the shipped Q4_1 file by default, its
own int8 activations and fp16 KV): for every prefix ``ids[:i + 1]`` one ``/completion`` request
(token-id prompt, ``n_predict`` 1, greedy, ``cache_prompt``: each request extends the previous
one by a token) with ``n_probs``, whose ``top_logprobs`` are the full softmax of the logits at
that position (llama.cpp computes them before sampling unless ``post_sampling_probs`` is set).
Its arg-max is the first entry; the text's next token's log-probability is read from the first
``--top-k`` entries, and where the token is not among them the request is repeated with every
token of the vocabulary listed, so the NLL is exact. llama-server has no prompt log-probabilities
(no ``echo``) and the sid tree no ``llama-perplexity``, hence one request per position.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx


def position_logprobs(body: dict[str, Any]) -> tuple[int, dict[int, float]]:
    """(arg-max id, {id: log-probability}) of the one generated position of a non-streamed
    ``/completion`` answer with ``n_probs`` (``completion_probabilities[0].top_logprobs``, best first)."""
    probs = body.get("completion_probabilities") or []
    if not probs or not probs[0].get("top_logprobs"):
        raise ValueError(f"no top_logprobs in llama-server's answer (keys {sorted(body)})")
    top = probs[0]["top_logprobs"]
    return int(top[0]["id"]), {int(t["id"]): float(t["logprob"]) for t in top}


def llama_server_position(url: str, timeout_s: float = 120.0) -> Callable[[list[int], int], tuple[int, dict[int, float]]]:
    """``ask(prefix, n_probs)``: llama-server's ``position_logprobs`` after ``prefix``."""
    client = httpx.Client(base_url=url, timeout=timeout_s)

    def ask(prefix: list[int], n_probs: int) -> tuple[int, dict[int, float]]:
        r = client.post("/completion", json={"prompt": prefix, "n_predict": 1, "temperature": 0.0,
                                             "ignore_eos": True, "cache_prompt": True, "n_probs": n_probs})
        r.raise_for_status()
        return position_logprobs(r.json())

    return ask


def teacher_forced_peer(ask: Callable[[list[int], int], tuple[int, dict[int, float]]], tokens: Sequence[int],
                        top_k: int, vocab: int) -> dict[str, Any]:
    """Each position's arg-max and the log-probability of the text's next token (exact: a
    position whose token is outside ``top_k`` is asked again with all ``vocab`` tokens)."""
    top1, target_logprobs, wide = [], [], 0
    for i in range(len(tokens) - 1):
        prefix, target = list(tokens[:i + 1]), int(tokens[i + 1])
        best, logprobs = ask(prefix, top_k)
        if target not in logprobs:
            wide += 1
            best, logprobs = ask(prefix, vocab)
        if target not in logprobs:
            raise ValueError(f"position {i}: token {target} not among all {vocab} log-probabilities")
        top1.append(best)
        target_logprobs.append(logprobs[target])
    return {"top1": top1, "target_logprobs": target_logprobs, "asked_again_with_every_token": wide}


def reference_fp32(tokens: Sequence[int]) -> dict[str, Any]:
    """transformers' fp32 arg-max and next-token log-probability at every position."""
    import torch

    from bench.peers.transformers import load_model

    model = load_model()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([list(tokens)])).logits[0, :-1].float(), dim=-1)
    target = torch.tensor(tokens[1:])
    return {"top1": [int(t) for t in logprobs.argmax(-1)],
            "target_logprobs": [float(v) for v in logprobs.gather(1, target[:, None])[:, 0]]}


def compare(reference: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Top-1 agreement and mean NLL (nats) of both sides, and the peer's NLL delta."""
    n = len(reference["top1"])
    if len(peer["top1"]) != n:
        raise ValueError(f"position counts differ: {n} vs {len(peer['top1'])}")
    agree = sum(a == b for a, b in zip(reference["top1"], peer["top1"]))
    nll_ref = -sum(reference["target_logprobs"]) / n
    nll_peer = -sum(peer["target_logprobs"]) / n
    return {"positions": n, "agree": agree, "top1_agreement": agree / n, "nll_reference": nll_ref,
            "nll_peer": nll_peer, "nll_delta": nll_peer - nll_ref}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from bench.machine import set_threads
    from bench.peers.llama_server import (LlamaServerConfig, ctx_size_for, package_version, resolve_gguf,
                                          start_llama_server)
    from bench.peers.gguf_files import gguf_weights
    from bench.probes.kv_int8 import FIXED_TEXT
    from bench.server import free_port
    from engine.loader import resolve_model_dir

    p = argparse.ArgumentParser(prog="python -m bench.probes.llama_server_agreement",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="the file llama-server runs (default: the shipped Q4_1; Q4_K_M, Q8_0, f32 or a path)")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--top-k", type=int, default=1000, help="log-probabilities listed per position first")
    p.add_argument("--num-threads", type=int)
    p.add_argument("--output", help="JSON path (default: print only)")
    args = p.parse_args(argv)
    threads = set_threads(args.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    tokens = tokenizer(FIXED_TEXT.read_text() * 4)["input_ids"][:args.tokens]
    if len(tokens) != args.tokens:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {args.tokens}")
    t = time.perf_counter()
    reference = reference_fp32(tokens)
    print(f"fp32 reference: {time.perf_counter() - t:.1f} s", flush=True)
    gguf = resolve_gguf(args.gguf)
    cfg = LlamaServerConfig(gguf, free_port(), threads, parallel=1, ctx_size=ctx_size_for(1, args.tokens + 16))
    server = start_llama_server(cfg)
    try:
        t = time.perf_counter()
        peer = teacher_forced_peer(llama_server_position(server.url), tokens, args.top_k, len(tokenizer))
        peer_s = time.perf_counter() - t
    finally:
        server.close()
    result = {"gguf": gguf_weights(gguf)["label"], "package": package_version(), "threads": threads,
              "tokens": len(tokens), "top_k": args.top_k, "seconds": round(peer_s, 1),
              "asked_again_with_every_token": peer["asked_again_with_every_token"], **compare(reference, peer)}
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
