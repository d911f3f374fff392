"""The ``kvserve`` command: ``generate`` (offline) and ``serve`` (the HTTP daemon)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from cache.eviction import EVICTION_POLICIES
from cache.config import KV_CACHE_DTYPES
from configs import build_section, check_sections, read_profile
from engine.attention.base import ATTENTION_BACKENDS
from engine.config import ACTIVATION_QUANTS, PREFILL_DTYPES
from engine.log_format import LOG_FORMATS, TEXT_FORMAT


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--config", help="YAML profile (default: configs/cpu.yaml)")
    g.add_argument("--model", help="a .gguf file or a local HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", dest="served_model_name")
    g.add_argument("--max-model-len", dest="max_model_len", type=int)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--num-threads", dest="num_threads", type=int)
    g.add_argument("--attention-backend", dest="attention_backend", choices=ATTENTION_BACKENDS)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float, metavar="FRACTION",
                   help="CUDA: share of GPU memory for weights, activations and the KV pool (default 0.9)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False,
                   help="CUDA: run decode steps eagerly instead of replaying captured graphs")
    g.add_argument("--linear-backend", dest="linear_backend", choices=["auto", "gguf", "onednn", "aten"])
    g.add_argument("--weights-resident", dest="weights_resident", choices=["auto", "dense", "blocks"],
                   help="keep a dense fp32 copy of GGUF matrices (dense), only their blocks (blocks), or "
                        "decide by size (auto: blocks above 1 GiB of dense weights)")
    g.add_argument("--decode-path", dest="decode_path", choices=["auto", "native", "python"],
                   help="all-decode steps as one C++ call over every layer (native) or torch ops (python); "
                        "auto: native on the CPU in float32 with the native attention backend")
    g.add_argument("--activation-quant", dest="activation_quant", choices=ACTIVATION_QUANTS,
                   help="int8: quantize the activations of the matmuls on GGUF blocks (llama.cpp's Q8 "
                        "activations; faster, approximate: see docs/configuration.md). Default auto: int8 on "
                        "GGUF block weights where the CPU has the int8 kernels, else none; none is exact fp32")
    g.add_argument("--prefill-attention-dtype", dest="prefill_attention_dtype",
                   choices=PREFILL_DTYPES,
                   help="the dtype a float32 model's prefill chunks attend in on the CPU; default auto: bfloat16 "
                        "(AMX tiles) where activation_quant is int8 and the CPU has AMX-BF16, else float32")
    g.add_argument("--prefill-matmul-dtype", dest="prefill_matmul_dtype", choices=PREFILL_DTYPES,
                   help="the dtype prefill chunks enter the block matmuls in; bfloat16: AMX-BF16 tiles (the "
                        "Q4_K / Q6_K from 32 rows, the other block formats but Q4_0 / Q5_1 from 128); default auto: bfloat16 where "
                        "activation_quant is int8 and the CPU has AMX-BF16, else float32 (the decode kernels)")
    g.add_argument("--block-size", dest="block_size", type=int)
    g.add_argument("--num-blocks", dest="num_blocks", type=int)
    g.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, metavar="GIB")
    g.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=KV_CACHE_DTYPES,
                   help="KV block dtype: auto (float16 on the CPU under a float32 model, as llama.cpp stores "
                        "KV; else the model's), float32 (the exact option under a float32 model), int8 "
                        "(per-token-per-head ranges, ~3.5x the tokens), float16 (half the bytes of fp32) "
                        "or int4 (KIVI: keys per channel and block, values per token, ~6x the tokens)")
    g.add_argument("--kv-disk-dir", dest="kv_disk_dir", metavar="PATH",
                   help="folder of the persistent disk tier of the prefix cache (off when unset)")
    g.add_argument("--kv-disk-gib", dest="kv_disk_gib", type=float, metavar="GIB", help="disk tier capacity")
    g.add_argument("--kv-offload-gib", dest="kv_offload_gib", type=float, metavar="GIB",
                   help="host-memory tier of the prefix cache for evicted blocks, before the disk tier "
                        "(pinned memory on GPU; 0 = off, the default)")
    g.add_argument("--kv-pin-fraction", dest="kv_pin_fraction", type=float,
                   help="most of the pool that cache_control pins may hold (default 0.25)")
    g.add_argument("--kv-eviction", dest="kv_eviction", choices=EVICTION_POLICIES,
                   help="evict KV inside a sequence: streaming keeps the first --kv-sink-tokens and the last "
                        "--kv-window-tokens (StreamingLLM), so a request may run past the context; h2o keeps the "
                        "sinks, the last --kv-recent-tokens and the blocks with the most accumulated attention within "
                         "--kv-budget-tokens (attention backends native, torch and triton) (default none)")
    g.add_argument("--kv-sink-tokens", dest="kv_sink_tokens", type=int, metavar="S",
                   help="streaming: tokens kept at the start of every sequence, in whole blocks (default 4)")
    g.add_argument("--kv-window-tokens", dest="kv_window_tokens", type=int, metavar="W",
                   help="streaming: most recent tokens kept, in whole blocks (default: the largest that fits the context)")
    g.add_argument("--kv-budget-tokens", dest="kv_budget_tokens", type=int, metavar="B",
                   help="h2o: tokens a sequence holds before a step, in whole blocks (required with h2o)")
    g.add_argument("--kv-recent-tokens", dest="kv_recent_tokens", type=int, metavar="R",
                   help="h2o: most recent tokens always kept (default: half of what the budget leaves beside the sinks)")
    g.add_argument("--kv-max-request-tokens", dest="kv_max_request_tokens", type=int, metavar="N",
                   help="under --kv-eviction: the most tokens (prompt + output) one request may run (default unlimited)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False)
    g.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int)
    g.add_argument("--max-num-seqs", dest="max_num_seqs", type=int)
    g.add_argument("--scheduling-policy", dest="policy", choices=["fcfs", "priority"],
                   help="priority: the request field 'priority' (and tenants' priority) orders admission and preemption")
    g.add_argument("--tensor-parallel-size", dest="tensor_parallel_size", type=int,
                   help="split the model over N ranks, one process each (gloo on CPU)")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_const", const=False)
    g.add_argument("--speculative-config", dest="speculative_config", metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 1, "prompt_lookup_max": 3}\' or \'{"method": "suffix"}\' '
                        '(requests without logprobs or a grammar; default off)')
    c = parser.add_argument_group("engine core")
    c.add_argument("--engine-mode", dest="mode", choices=["process", "thread"],
                   help="run the engine core in its own process (default; restarted if it dies) or in a thread")
    c.add_argument("--max-core-failures", dest="max_failures", type=int,
                   help="core deaths within --core-failure-window after which the server exits non-zero (default 3)")
    c.add_argument("--burst-gap-ms", dest="burst_gap_ms", type=float, metavar="MS",
                   help="an idle core waits for requests that follow the first one within this many ms of each "
                        "other (at most 8 gaps) before stepping, so a burst prefills together (default 4; 0: at once)")
    c.add_argument("--core-failure-window", dest="failure_window_s", type=float, metavar="SECONDS",
                   help="the window of --max-core-failures (default 300)")


def build_engine_config(args: argparse.Namespace, extra_sections: set[str] = frozenset()) -> Any:
    from cache import CacheConfig
    from engine.config import EngineCoreConfig, ModelConfig
    from engine.config import EngineConfig
    from scheduler.config import SchedulerConfig

    profile = read_profile(args.config)
    check_sections(profile, {"model", "cache", "scheduler", "core", "server"} | set(extra_sections))
    flags = vars(args)
    model = build_section(ModelConfig, "model", profile, flags)
    if args.max_model_len is None and model.max_model_len is not None:
        # the profile's context length bounds it; only an explicit --max-model-len is exact
        model = dataclasses.replace(model, max_model_len_is_cap=True)
    return EngineConfig(
        model=model,
        cache=build_section(CacheConfig, "cache", profile, flags),
        scheduler=build_section(SchedulerConfig, "scheduler", profile, flags),
        core=build_section(EngineCoreConfig, "core", profile, flags),
    ), profile


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from kvtypes.sampling_params import SamplingParams
    from engine.tokenizer import encode_chat

    config, _ = build_engine_config(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine = LLMEngine(config)
    prompt: Any = args.prompt
    if args.chat:
        prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    result = engine.generate([prompt], params)[0]
    print(result.text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from kvserve.compose import build_service
    from server.access_log import use_log_format
    from server.app import serve
    from server.config import ServerConfig

    config, profile = build_engine_config(args)
    flags = vars(args)
    if flags.get("api_key") is None and not flags.get("api_key_file") and os.environ.get("KVSERVE_API_KEY"):
        flags["api_key"] = os.environ["KVSERVE_API_KEY"]
    server_config = build_section(ServerConfig, "server", profile, flags)
    use_log_format(server_config.log_format)
    service = build_service(config, server_config)
    logging.getLogger(__name__).info("serving %s on http://%s:%d (auth %s)", service.engine.model_name,
                                     server_config.host, server_config.port,
                                     "key file" if server_config.api_key_file else
                                     "on" if server_config.api_key else "off")
    # SIGTERM drains and exits 0 (see server.app.DrainingServer); a core that keeps dying exits 3.
    started = serve(service.app, service.engine, server_config)
    if service.engine.fatal:
        logging.getLogger(__name__).critical("exiting: the engine core kept failing")
        return 3
    return 0 if started else 1


def cmd_bench(args: argparse.Namespace) -> int:
    """``kvserve bench ARGS`` is ``python -m bench ARGS`` in this process's place: the bench
    sits above the product (it drives kvserve and its peers), so the CLI hands over to it
    instead of importing it."""
    os.environ["KVSERVE_BENCH_PROG"] = "kvserve bench"
    # bandit B606: no shell, own CLI args
    os.execv(sys.executable, [sys.executable, "-m", "bench", *args.bench_args])  # nosec B606
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible LLM serving over a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    s = serve.add_argument_group("server")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--api-key", dest="api_key", help="require 'Authorization: Bearer KEY' (or set KVSERVE_API_KEY)")
    s.add_argument("--api-key-file", dest="api_key_file", metavar="PATH",
                   help="YAML key file of tenants (keys, limits, priority, cache salt, rights); re-read on SIGHUP")
    s.add_argument("--max-waiting", dest="max_waiting", type=int, help="queue length beyond which requests get 429")
    s.add_argument("--metrics-compat", dest="metrics_compat", choices=["vllm"],
                   help="also export the vLLM metric names that routers read (vllm:num_requests_waiting, ...)")
    s.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, metavar="SECONDS")
    s.add_argument("--log-format", dest="log_format", choices=LOG_FORMATS,
                   help="json: every log line, the per-request access log's too, one JSON object (default text)")
    serve.set_defaults(func=cmd_serve)

    # `kvserve bench ...` is `python -m bench ...` (its own parser and --help).
    bench = sub.add_parser("bench", add_help=False, help="benchmarks against peers (python -m bench --help)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # forward verbatim: REMAINDER would not take a leading option such as --help
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT, stream=sys.stderr)
    for noisy in ("httpx", "transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input of any kind: one clear line, no traceback wall
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
