"""Shared pieces of the benchmarks: model loading, prompts, timing, machine facts, results.

Every benchmark runs kvserve and its transformers peer in one process, on the same weights
and the same torch thread count, and reports ratios rather than absolute numbers: absolute
throughput on a shared 2-core machine moves by 2x from one minute to the next, ratios
measured back to back move much less. The load average is recorded next to every result
so that a run made while something else was busy can be recognised.
"""
from __future__ import annotations

import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Chat-style requests (short questions, as a chat UI sends them). Rendered with the model's
# chat template when it has one.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a hash table works in simple terms.",
    "Give me three tips for learning to play the guitar.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a string.",
    "What are the main causes of climate change?",
    "Describe a healthy breakfast.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "How does a bicycle stay upright?",
    "List five famous painters and one work by each.",
    "What is machine learning?",
    "Explain recursion to a ten year old.",
    "What should I pack for a weekend hiking trip?",
    "How do I make a good cup of coffee?",
    "Tell me a fun fact about octopuses.",
    "What is the Pythagorean theorem?",
    "Write an email asking my manager for a day off.",
    "How does the internet work?",
]


def set_threads(num_threads: int | None) -> int:
    """Use ``num_threads`` intra-op threads (default: the cores this process may use)."""
    from engine.builder import available_cores

    n = num_threads or available_cores()
    torch.set_num_threads(n)
    return n


def machine_info() -> dict[str, Any]:
    """Facts that explain a number: torch version and threads, cores, load average."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "threads": torch.get_num_threads(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg_1m": round(load[0], 2),
        "loadavg_5m": round(load[1], 2),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


class CpuMonitor:
    """How much CPU *other* processes used while a block ran (from /proc/stat and this
    process's own CPU time). ``foreign_cores`` near 0 means the measurement had the machine
    to itself; 0.5 or more on a 2-core machine makes 2-thread matmuls unreliable."""

    def __enter__(self) -> "CpuMonitor":
        self._busy0, self._own0, self._t0 = _system_busy_s(), _own_cpu_s(), time.perf_counter()
        self.foreign_cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own, wall = _system_busy_s(), _own_cpu_s(), time.perf_counter() - self._t0
        if busy is not None and self._busy0 is not None and wall > 0:
            self.foreign_cores = round(max(0.0, (busy - self._busy0) - (own - self._own0)) / wall, 2)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 1.0) -> float | None:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold_cores`` cores
    over a ``window_s`` window; returns the last foreign load seen (None if unknown)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with CpuMonitor() as mon:
            time.sleep(window_s)
        if mon.foreign_cores is None or mon.foreign_cores < threshold_cores or time.monotonic() >= deadline:
            return mon.foreign_cores


def _system_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process (Linux /proc), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (a server's frontend, engine
    core and tensor-parallel ranks). Linux only; 0.0 elsewhere."""
    if not Path("/proc").is_dir():
        return 0.0
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
            todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - informational only
        return None


def load_default_pair(num_threads: int | None = None, max_model_len: int = 2048, kv_cache_gib: float = 1.0,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 512, with_hf: bool = True):
    """kvserve's LLMEngine and transformers' model on the same dense weights of the default model."""
    from transformers import AutoModelForCausalLM

    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.loader import resolve_model_dir
    from scheduler.config import SchedulerConfig

    threads = set_threads(num_threads)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=threads, max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_memory_gib=kv_cache_gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)))
    if not with_hf:
        return engine, None
    path, _ = resolve_model_dir(None)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    return engine, hf


def chat_prompts(tokenizer: Any, n: int, offset: int = 0, vocab_size: int | None = None,
                 seed: int = 0, length: int = 24) -> list[list[int]]:
    """``n`` chat-style prompts as token ids (``offset`` picks a disjoint set of questions).

    Without a tokenizer (tiny test models) the prompts are random ids of ``length`` tokens.
    """
    if tokenizer is None:
        rng = random.Random(seed * 7919 + offset)
        low = min(3, vocab_size - 1)
        return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]
    from engine.tokenizer import encode_chat, encode_prompt

    prompts = []
    for i in range(n):
        question = CHAT_QUESTIONS[(offset + i) % len(CHAT_QUESTIONS)]
        if (offset + i) >= len(CHAT_QUESTIONS):
            question += f" (variant {(offset + i) // len(CHAT_QUESTIONS)})"
        messages = [{"role": "user", "content": question}]
        if getattr(tokenizer, "chat_template", None):
            prompts.append(encode_chat(tokenizer, messages))
        else:
            prompts.append(encode_prompt(tokenizer, question))
    return prompts


def weight_bytes_per_decode_token(engine: Any) -> int:
    """Bytes of weights one kvserve decode step streams with its kernels in use: every
    layer's matrices and norms, the final norm and the LM head (the embedding lookup reads
    one row and is not counted); GGUF blocks where the decode matmuls read blocks."""
    return engine.runner.model.decode_weight_bytes()


def hf_weight_bytes_per_decode_token(hf_model: Any) -> int:
    """The same count for a transformers model: all its (dense) parameters but the input
    embedding, which is counted once as the LM head when the two are tied."""
    total = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    if not hf_model.config.tie_word_embeddings:
        emb = hf_model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total


def memory_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of a ``sum`` over a tensor far larger than the caches, best of
    ``repeats``, with the current torch thread count."""
    x = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    nbytes = x.numel() * 4
    del x
    return nbytes / best / 1e9


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def verdict(value: float | None, target: float) -> str:
    return "PASS" if value is not None and value >= target else "FAIL"


def print_table(title: str, rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def write_results(name: str, result: dict[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Write ``result`` as JSON to ``path`` or ``bench/results/<name>-<timestamp>.json``."""
    if path is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path
