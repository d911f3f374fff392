"""transformers as a peer: ``generate`` (single stream, static left-padded batches) and its
continuous batching, on the default model's dense fp32 weights.

* ``load_model()``: the default model's transformers twin (fp32, the weights kvserve loads);
* ``hf_single`` / ``hf_batch``: one greedy ``generate`` call, timed (first token, decode after it);
* ``run_hf_static`` / ``run_hf_continuous``: a request list (objects with ``prompt_token_ids``
  and ``output_len``) through static batches / the manager behind ``generate_batch``;
* ``hf_top1``: the arg-max after every prefix of a text from one forward pass (the agreement
  oracle, ``bench.agreement``);
* ``hf_weight_bytes_per_decode_token``: what one decode token reads, by kvserve's rule.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch


def load_model(path: str | None = None) -> Any:
    """transformers' ``AutoModelForCausalLM`` of ``path`` (default: the default model's folder), fp32, eval."""
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model_dir

    if path is None:
        path, _ = resolve_model_dir(None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


class TimingStreamer:
    """transformers streamer that records when each new token arrives (batch size 1)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_single(model: Any, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    streamer = TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, streamer=streamer,
                             pad_token_id=pad_id(model))
    end = time.perf_counter()
    return {"tokens": out[0, ids.shape[1]:].tolist(), "ttft_s": streamer.times[0] - start,
            "decode_s": end - streamer.times[0]}


def hf_batch(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    """One left-padded batched ``generate`` call."""
    pad = pad_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return {"tokens": out[:, width:].tolist(), "elapsed_s": elapsed}


def pad_id(model: Any) -> int:
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "pad_token_id", None), getattr(model.config, "pad_token_id", None),
                  getattr(gen, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


class ContinuousTimeout(TimeoutError):
    """transformers' continuous batching did not finish the workload within the time limit."""

    def __init__(self, finished: int, count: int, timeout_s: float) -> None:
        super().__init__(f"continuous batching finished {finished}/{count} requests in {timeout_s:.0f} s")
        self.finished, self.timeout_s = finished, timeout_s


def run_hf_static(model: Any, requests: Sequence[Any], batch_size: int = 16) -> dict[str, Any]:
    pad = pad_id(model)
    useful = generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, use_cache=True, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
        useful += sum(min(r.output_len, out.shape[1] - width) for r in batch)
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": useful, "generated_tokens": generated,
            "batch_size": batch_size}


def run_hf_continuous(model: Any, requests: Sequence[Any], timeout_s: float = 600.0,
                      max_batch_tokens: int | None = None) -> dict[str, Any]:
    """transformers' continuous batching (the manager behind ``generate_batch``), greedy, EOS off.

    ``generate_batch`` itself takes one ``max_new_tokens`` for all requests, so the same
    manager is driven directly with each request's own length.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                  eos_token_id=-1, pad_token_id=pad_id(model))
    # Size the paged cache for this workload (all requests resident at once, as kvserve's pool
    # allows): left to itself the manager claims most of the free RAM, which takes tens of
    # seconds to allocate here and starves everything else on the machine.
    page = ContinuousBatchingConfig().page_size
    num_blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests) + 4
    cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        # The manager's first step sizes its cache and may warm up; keep that out of the timing
        # by running one short request first.
        manager.add_request(requests[0].prompt_token_ids[:16], request_id="warmup", max_new_tokens=2)
        _collect(manager, 1, timeout_s)
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len)
        results = _collect(manager, len(requests), timeout_s)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"elapsed_s": elapsed, "output_tokens": tokens, "num_blocks": num_blocks, "page_size": page,
            "max_batch_tokens": max_batch_tokens}


def _collect(manager: Any, count: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[str, Any] = {}
    while len(results) < count:
        if time.monotonic() > deadline:
            raise ContinuousTimeout(len(results), count, timeout_s)
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching manager stopped before finishing")
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"continuous batching request failed: {result.error}")
        if result.is_finished():
            results[result.request_id] = result
    return results


def hf_top1(model: Any, ids: Sequence[int], start: int = 1) -> list[int]:
    """transformers' arg-max after every prefix, from one forward pass (fp32)."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)])).logits[0]
    return [int(t) for t in logits.argmax(-1)[start - 1:len(ids) - 1]]


def hf_weight_bytes_per_decode_token(hf_model: Any) -> int:
    """The same count for a transformers model: all its (dense) parameters but the input
    embedding, which is counted once as the LM head when the two are tied."""
    total = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    if not hf_model.config.tie_word_embeddings:
        emb = hf_model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total
