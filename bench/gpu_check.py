"""GPU throughput check: kvserve on a Llama-3.1-8B-shaped model with random bf16 weights.

Nothing is downloaded: the weights are drawn on the device from a fixed seed (the same
weights for kvserve and transformers). The workload is nano-vllm's benchmark: ``N``
requests whose prompt and output lengths are uniform in ``[lo, hi]`` (random token ids,
``ignore_eos`` so every request produces exactly its output length, temperature 0.6).

Phases, in this order (kvserve is freed before transformers loads, so each side has the
GPU's memory to itself):

1. ``batch1``: one stream decoding, the median step time next to the weight-streaming
   bound (decode weight bytes / ``--hbm-gbs``);
2. ``offline``: all requests through the in-process engine (``LLMEngine.generate``);
3. ``http``: the same requests through the OpenAI server at ``--concurrency`` (streaming
   completions; TTFT/TPOT per request, as vLLM's benchmark_serving computes them);
4. ``subset_kvserve`` and ``hf``: the first ``--hf-requests`` requests through kvserve and
   through one left-padded ``transformers.generate`` batch (useful tokens only: a padded
   row's extra steps do not count), side by side.

``--smoke`` runs every phase on a tiny model with tiny lengths (on the CPU by default) to
prove the plumbing; its numbers mean nothing. Writes ``<out>/<name>.json`` and ``.md``.

    python -m bench.gpu_check --out bench/results/gpu-check            # on the GPU
    python -m bench.gpu_check --smoke --device cpu --out /tmp/smoke    # anywhere
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger("bench.gpu_check")

LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

# The targets (H200, one run).
TARGETS = {"offline_output_tps": 10_000.0, "hf_ratio": 10.0, "http_tpot_p50_ms": 20.0, "batch1_bound_ratio": 2.0}


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


def make_requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def hf_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names -> shapes."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h),
                                          "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def random_state_dict(config: dict[str, Any], device: torch.device, dtype: torch.dtype,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights drawn on ``device`` (N(0, 0.02), norms at one); the same seed gives the
    same weights, so kvserve and transformers run the same model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in hf_weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return out


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose token ``i`` is the word ``t<i>``: random weights need no
    real vocabulary, but the server streams text, and TTFT/TPOT are timed on text chunks."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The unknown token sits past the model's vocabulary: no generated id is special (skipped).
    vocab = {f"t{i}": i for i in range(vocab_size)} | {"<unk>": vocab_size}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def build_engine(args: argparse.Namespace, config: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    from cache import CacheConfig
    from engine.model.arch import ModelArch
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import LoadedModel
    from scheduler.config import SchedulerConfig

    hf_config = LlamaConfig(**config)
    device = torch.device(args.device)
    state = random_state_dict(config, device, getattr(torch, args.dtype), args.seed)
    loaded = LoadedModel(path=None, name="llama-3.1-8b-shape-random" if not args.smoke else "tiny-random",
                         hf_config=hf_config, arch=ModelArch.from_hf_config(hf_config), state_dict=state,
                         tokenizer=synthetic_tokenizer(config["vocab_size"]))
    engine_config = EngineConfig(
        model=ModelConfig(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
                          max_model_len=2 * args.max_len + 16, gpu_memory_utilization=args.gpu_memory_utilization,
                          cuda_graphs=not args.no_cuda_graphs),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_gib=args.kv_cache_memory_gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs))
    start = time.perf_counter()
    engine = LLMEngine(engine_config, loaded)
    del state, loaded
    return engine, time.perf_counter() - start


def sampling(output_len: int) -> Any:
    from kvtypes.sampling_params import SamplingParams

    return SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True, seed=None)


def phase_batch1(engine: Any, prompt_len: int, new_tokens: int, hbm_gbs: float) -> dict[str, Any]:
    """One stream: the median decode step, against the time to stream the decode weights once."""
    engine.add_request(list(range(1, prompt_len + 1)), sampling(new_tokens))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()  # reads the sampled token back: the step has finished on the device
        times.append(time.perf_counter() - t0)
    steps = times[1:]  # the first step is the prefill
    weight_bytes = engine.runner.model.decode_weight_bytes()
    bound_ms = weight_bytes / (hbm_gbs * 1e9) * 1e3
    median_ms = statistics.median(steps) * 1e3 if steps else None
    return {"prompt_len": prompt_len, "decode_steps": len(steps), "step_median_ms": _r(median_ms),
            "step_p90_ms": _r(sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3) if steps else None,
            "decode_weight_gb": round(weight_bytes / 1e9, 3), "hbm_gbs": hbm_gbs, "bound_ms": _r(bound_ms, 3),
            "bound_ratio": _r(median_ms / bound_ms) if median_ms else None}


def phase_offline(engine: Any, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Token ids in, token ids out (no incremental detokenization, as nano-vllm's benchmark)."""
    tokenizer, engine.tokenizer = engine.tokenizer, None
    try:
        start = time.perf_counter()
        results = engine.generate([r.prompt for r in requests], [sampling(r.output_len) for r in requests])
        elapsed = time.perf_counter() - start
    finally:
        engine.tokenizer = tokenizer
    out_tokens = sum(len(r.token_ids) for r in results)
    assert out_tokens == sum(r.output_len for r in requests), "a request ended early"
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return {"requests": len(requests), "elapsed_s": _r(elapsed, 3), "output_tokens": out_tokens,
            "prompt_tokens": prompt_tokens, "output_tps": _r(out_tokens / elapsed, 1),
            "total_tps": _r((out_tokens + prompt_tokens) / elapsed, 1),
            "preemptions": engine.scheduler.stats.num_preemptions}


def phase_http(engine: Any, requests: Sequence[BenchRequest], concurrency: int) -> dict[str, Any]:
    from bench.client import completion_request, run_load, scrape_metrics, summarize
    from bench.server import start_inprocess
    # This script is an entry point (like kvserve.cli): it composes the served app itself, through
    # the composition root, around the engine it already built (the core as a thread of it).
    from engine.config import EngineCoreConfig
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    service = build_service(EngineConfig(core=EngineCoreConfig(mode="thread")), ServerConfig(log_stats_interval_s=0),
                            engine=engine)
    server = start_inprocess(service.app, service.engine.model_name)
    try:
        reqs = [completion_request(r.prompt, r.output_len, temperature=0.6) for r in requests]
        records, elapsed = run_load(server, reqs, concurrency)
        metrics = scrape_metrics(server)
    finally:
        server.close()
    summary = summarize(records, elapsed)
    summary["concurrency"] = concurrency
    summary["metrics_scraped"] = metrics is not None and any(k.startswith("kvserve_") for k in metrics)
    return summary


def phase_hf(args: argparse.Namespace, config: dict[str, Any], requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """One left-padded ``generate`` batch of ``requests`` on the same device and weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    hf_config = LlamaConfig(**config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(random_state_dict(config, device, dtype, args.seed))
    model.eval()
    width = max(len(r.prompt) for r in requests)
    new = max(r.output_len for r in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                       temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    _sync(device)
    elapsed = time.perf_counter() - start
    useful = sum(r.output_len for r in requests)
    del model
    return {"requests": len(requests), "batch": len(requests), "elapsed_s": _r(elapsed, 3), "max_new_tokens": new,
            "useful_output_tokens": useful, "output_tps": _r(useful / elapsed, 1),
            "generated_tokens": new * len(requests), "raw_tps": _r(new * len(requests) / elapsed, 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _r(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)


def device_info(device: torch.device) -> dict[str, Any]:
    from bench.machine import machine_info

    info = machine_info()
    info["device"] = str(device)
    info["triton"] = _module_version("triton")
    info["flash_attn"] = _module_version("flash_attn")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sms=props.multi_processor_count)
    return info


def _module_version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except Exception:  # not installed, or broken: report it as absent
        return None


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's speed lines: value, target, pass/fail (None when the phase did not run)."""
    offline = result.get("offline") or {}
    http = result.get("http") or {}
    b1 = result.get("batch1") or {}
    sub, hf = result.get("subset_kvserve") or {}, result.get("hf") or {}
    ratio = sub["output_tps"] / hf["output_tps"] if sub.get("output_tps") and hf.get("output_tps") else None
    rows = {"offline_output_tps": (offline.get("output_tps"), ">="), "hf_ratio": (_r(ratio), ">="),
            "http_tpot_p50_ms": (http.get("tpot_p50_ms"), "<="), "batch1_bound_ratio": (b1.get("bound_ratio"), "<=")}
    out = {}
    for name, (value, op) in rows.items():
        target = TARGETS[name]
        ok = None if value is None else (value >= target if op == ">=" else value <= target)
        out[name] = {"value": value, "target": f"{op} {target:g}", "pass": ok}
    return out


def markdown(result: dict[str, Any]) -> str:
    info, cfg = result["machine"], result["config"]
    lines = [f"# kvserve GPU check{' (SMOKE: plumbing only, numbers mean nothing)' if cfg['smoke'] else ''}", "",
             f"Date: {result['date']}. Device: {info.get('gpu', info['device'])} "
             f"({info.get('gpu_memory_gib', '-')} GiB, CUDA {info.get('cuda', '-')}), torch {info['torch']}, "
             f"triton {info['triton']}, flash-attn {info['flash_attn']}, transformers {info['transformers']}.", "",
             f"Model: {cfg['model']} ({cfg['dtype']}, random weights, seed {cfg['seed']}); attention "
             f"{result.get('attention', '-')}; CUDA graphs {'off' if cfg['no_cuda_graphs'] else 'on'}; "
             f"{cfg['num_requests']} requests, prompt and output lengths uniform in "
             f"[{cfg['min_len']}, {cfg['max_len']}]; engine start {result.get('engine_start_s')} s; "
             f"KV pool {result.get('kv_capacity', '-')}.", "",
             "Command: `" + result["command"] + "`", "", "## Targets", "",
             "| line | value | target | pass |", "|---|---|---|---|"]
    for name, v in result["verdicts"].items():
        lines.append(f"| {name} | {v['value']} | {v['target']} | {v['pass']} |")
    for phase in ("batch1", "offline", "http", "subset_kvserve", "hf"):
        data = result.get(phase)
        if data is None:
            continue
        lines += ["", f"## {phase}", "", "| key | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in data.items()]
    if result.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths: checks the plumbing anywhere")
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --smoke)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (8 with --smoke)")
    p.add_argument("--min-len", type=int, default=None, help="default 100 (4 with --smoke)")
    p.add_argument("--max-len", type=int, default=None, help="default 1024 (16 with --smoke)")
    p.add_argument("--concurrency", type=int, default=None, help="default 64 (4 with --smoke)")
    p.add_argument("--http-requests", type=int, default=None, help="default: all of --num-requests")
    p.add_argument("--hf-requests", type=int, default=None, help="default 16 (2 with --smoke)")
    p.add_argument("--batch1-tokens", type=int, default=None, help="decode steps timed for batch 1 (default 128)")
    p.add_argument("--hbm-gbs", type=float, default=4800.0, help="memory bandwidth for the batch-1 bound (H200)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="CPU only (CUDA profiles the pool)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--skip", default="", help="comma-separated phases to skip (batch1,offline,http,hf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/gpu-check")
    p.add_argument("--name", default="gpu-check", help="report file stem")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    import sys

    args = build_parser().parse_args(argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke else "cuda")
    for name, full, tiny in (("num_requests", 256, 8), ("min_len", 100, 4), ("max_len", 1024, 16),
                             ("concurrency", 64, 4), ("hf_requests", 16, 2), ("batch1_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if smoke else full)
    if smoke:
        args.max_num_seqs = min(args.max_num_seqs, 16)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = TINY if smoke else LLAMA_31_8B
    device = torch.device(args.device)
    skip = {s for s in args.skip.split(",") if s}
    requests = make_requests(args.num_requests, args.min_len, args.max_len, config["vocab_size"], args.seed)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": device_info(device),
                              "command": " ".join(["python -m bench.gpu_check", *(argv or sys.argv[1:])]),
                              "config": {**vars(args), "model": "tiny" if smoke else "Llama-3.1-8B shape"},
                              "errors": []}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """Write the report so far: a run cut short by a time limit still leaves its numbers."""
        result["verdicts"] = verdicts(result)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
        (out / f"{args.name}.md").write_text(markdown(result))

    def attempt(phase: str, fn: Any) -> None:
        if phase in skip:
            return
        logger.info("phase %s ...", phase)
        try:
            result[phase] = fn()
            logger.info("phase %s: %s", phase, json.dumps(result[phase]))
        except Exception as exc:  # report and go on: one failing phase must not hide the others
            logger.exception("phase %s failed", phase)
            result["errors"].append(f"{phase}: {type(exc).__name__}: {exc}")
        save()

    # transformers first, on an empty device: the engine's profiled KV pool takes ~90% of the
    # GPU, and the first H200 run's generate after it ran out of memory (the pool was not given
    # back within the process); the engine then profiles what transformers left free.
    attempt("hf", lambda: phase_hf(args, config, requests[:args.hf_requests]))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = None
    try:
        engine, result["engine_start_s"] = build_engine(args, config)
        result["engine_start_s"] = _r(result["engine_start_s"])
        result["attention"] = engine.runner.model.attn.describe()
        result["cuda_graphs"] = engine.runner.graphs is not None
        result["kv_capacity"] = engine.capacity.describe(engine.max_model_len)
        save()
        attempt("batch1", lambda: phase_batch1(engine, args.min_len, args.batch1_tokens, args.hbm_gbs))
        attempt("offline", lambda: phase_offline(engine, requests))
        attempt("http", lambda: phase_http(engine, requests[:args.http_requests or len(requests)], args.concurrency))
        if "hf" not in skip:
            attempt("subset_kvserve", lambda: phase_offline(engine, requests[:args.hf_requests]))
    except Exception as exc:
        logger.exception("engine failed")
        result["errors"].append(f"engine: {type(exc).__name__}: {exc}")
    finally:
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
