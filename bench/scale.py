"""Scale-out smoke: kvserve replicas behind sglang-router on one machine (``python -m bench.scale``).

Runs (each step prints one PASS/FAIL line; scripts/scale-smoke.sh is the entry point):

1. ``cache-aware`` vs ``round-robin``: a multi-tenant prefix workload (``--tenants`` system
   prompts of about ``--prompt-tokens`` tokens, ``--requests`` requests, a few output tokens
   each; tenants take turns in rounds of seeded permutations) through the router with each
   policy, on the same two replicas (fresh tenants for the second policy). The cached-token
   fraction is ``sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens)``
   over all responses. Each replica's KV pool holds half of the tenants' prefixes
   (``--num-blocks``): cache-aware routing keeps each tenant on one replica, so the two pools
   together hold them all; round-robin sends every tenant everywhere, and the pools thrash.
   The router places each new tenant itself, and in about 1 run in 4 it puts 5 or 6 of the 8
   on one replica, whose pool then thrashes whatever kvserve does: the cache-aware step then
   runs again with fresh tenants (up to ``SmokeConfig.placement_retries`` times) and reports
   the placement it was measured under.
2. ``failover``: long streams through the router, then one replica is SIGKILLed: the
   streams it held must end with an error (not hang), the others must finish, and every
   request sent afterwards must succeed (the router routes around the dead replica).
3. ``--throughput``: the same workload with longer outputs through two single-threaded
   replicas behind the router vs one single-threaded replica; output tokens/s of each. By
   default (``--pin auto``, with >= 2 cores) each replica is pinned to a core of its own, and
   each run prints every replica's (and the router's, and the client's) CPU time, so a reader
   can tell a starved replica from a slow one.

The replicas are ``python -m kvserve.cli serve`` subprocesses, the router is
``python -m sglang_router.launch_router`` (PyPI ``sglang-router``); everything binds to
127.0.0.1 on free ports and is killed on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import httpx

from bench.machine import tree_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
# Words of one length, so every tenant's prompt has the same number of characters: sglang-router's
# cache_aware policy sends a prompt it has not seen to the worker with the smallest radix tree
# (in characters), so equal prompts split the tenants evenly between the workers.
WORDS = ("account", "invoice", "payment", "carrier", "shipped", "pallets", "refunds", "tariffs", "drivers",
         "returns", "regions", "ledgers", "permits", "budgets", "reports", "vendors", "surveys", "storage",
         "freight", "parcels", "clients", "rebates", "credits", "audited")


# Output tokens of each first-round request: the two of a pair overlap; at most the spare
# blocks that ``SmokeConfig.blocks_for`` leaves per replica (2 * concurrency blocks of 16).
INTRO_TOKENS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tenant_prompts(num: int, tokens: int, seed: int = 0) -> list[str]:
    """``num`` distinct system prompts of about ``tokens`` tokens (SmolLM2's tokenizer: ~1.2 a word here)."""
    out = []
    for t in range(num):
        rng = random.Random(seed * 1000 + t)
        body = " ".join(rng.choice(WORDS) for _ in range(int(tokens / 1.2)))
        out.append(f"Tenant {t:03d} policy. {body}.\n")
    return out


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _spawn(name: str, cmd: list[str], url: str, log_dir: Path, env: dict | None = None,
           cpus: set[int] | None = None) -> Process:
    """Start ``cmd``; with ``cpus``, pinned to those cores (set at once, before the server spawns
    its engine core process, which inherits the affinity)."""
    log = log_dir / f"{name}.log"
    f = log.open("w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    f.close()
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return Process(name, url, proc, log)


def wait_ready(p: Process, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not p.alive():
            raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}")
        try:
            if httpx.get(p.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{p.name} not ready after {timeout:.0f}s:\n{p.tail()}")


@dataclass
class ReplicaSpec:
    model: str | None = None  # None: the default model
    num_threads: int = 1
    max_model_len: int = 1024
    num_blocks: int | None = None
    extra: list[str] = field(default_factory=list)

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--num-threads", str(self.num_threads), "--max-model-len", str(self.max_model_len),
               "--metrics-compat", "vllm", *self.extra]
        if self.model:
            cmd += ["--model", self.model]
        if self.num_blocks:
            cmd += ["--num-blocks", str(self.num_blocks)]
        return cmd


def start_replicas(n: int, spec: ReplicaSpec, log_dir: Path, timeout: float = 300,
                   cores: CorePlan | None = None) -> list[Process]:
    """``n`` replicas; with ``cores``, replica ``i`` pinned to ``cores.replicas[i]``."""
    reps = []
    for i in range(n):
        port = free_port()
        reps.append(_spawn(f"replica{i}", spec.command(port), f"http://127.0.0.1:{port}", log_dir,
                           env={"OMP_NUM_THREADS": str(spec.num_threads)},
                           cpus=cores.replicas[i] if cores is not None else None))
    for r in reps:
        wait_ready(r, "/health", timeout)
    return reps


def router_command(port: int, workers: Sequence[str], policy: str, prometheus_port: int) -> list[str]:
    """sglang-router in front of kvserve replicas; health checks every 2 s, out after 2 failures."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--health-check-endpoint", "/health", "--health-check-interval-secs", "2",
            "--health-failure-threshold", "2", "--health-check-timeout-secs", "2",
            "--request-timeout-secs", "600", "--log-level", "warn"]


def start_router(workers: Sequence[str], policy: str, log_dir: Path, timeout: float = 60,
                 cpus: set[int] | None = None) -> Process:
    port, prom = free_port(), free_port()
    r = _spawn(f"router-{policy}", router_command(port, workers, policy, prom), f"http://127.0.0.1:{port}",
               log_dir, cpus=cpus)
    wait_ready(r, "/health", timeout)
    # The router is up before its workers are registered: wait until it lists them all.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(r.url + "/workers", timeout=2).json()
            if len(body.get("workers", [])) >= len(workers):
                return r
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"router did not register {len(workers)} workers:\n{r.tail()}")


@dataclass
class WorkloadResult:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    # the first round's requests served by each replica (run_prefix_workload's ``served``), i.e.
    # where the router placed the tenants
    first_round_per_replica: list[int] = field(default_factory=list)

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def run_prefix_workload(url: str, prompts: Sequence[str], num_requests: int, max_tokens: int, concurrency: int,
                        seed: int = 0, timeout: float = 600, model: str | None = None,
                        served: Callable[[], list[float]] | None = None) -> WorkloadResult:
    """``num_requests`` completions, each a tenant's prompt plus a short question, in a seeded order.

    ``model``: the served model name (default: asked from ``url``; sglang-router answers "unknown").
    ``served``: each replica's count of finished requests, read before and after the first round."""
    model = model or model_name(url)
    # Tenants take turns: rounds, each a seeded permutation of the tenants (the last one cut short).
    rng, order = random.Random(seed), []
    while len(order) < num_requests:
        order += rng.sample(range(len(prompts)), len(prompts))
    order = order[:num_requests]
    result, lock = WorkloadResult(), threading.Lock()

    def one(k: int, tokens: int = max_tokens) -> None:
        body = {"model": model, "prompt": f"{prompts[order[k]]}Question {k}: status?", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        try:
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
        except (httpx.HTTPError, KeyError, ValueError):
            with lock:
                result.errors += 1
            return
        with lock:
            result.requests += 1
            result.prompt_tokens += usage["prompt_tokens"]
            result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            result.completion_tokens += usage["completion_tokens"]

    with httpx.Client(base_url=url, timeout=timeout) as client:
        t0 = time.monotonic()
        # The first round introduces the tenants two at a time, the two requests of a pair released
        # together by a barrier and generating INTRO_TOKENS so that they overlap. sglang-router's
        # cache_aware sends an unseen prompt to the least loaded worker, so each pair splits over
        # the two workers. Unseen prompts that meet idle workers one at a time all land on the
        # same one (a free-running start split the tenants 5/3 on some runs). Placement stays the
        # router's decision; only the timing is fixed.
        first_round = min(len(prompts), num_requests)
        before = served() if served is not None else []
        with ThreadPoolExecutor(2) as pool:
            for k in range(0, first_round, 2):
                ks = list(range(k, min(k + 2, first_round)))
                barrier = threading.Barrier(len(ks))

                def introduce(j: int, barrier: threading.Barrier = barrier) -> None:
                    barrier.wait()
                    one(j, max(max_tokens, INTRO_TOKENS))

                list(pool.map(introduce, ks))
        if served is not None:
            result.first_round_per_replica = [round(b - a) for a, b in zip(before, served())]
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(first_round, num_requests)))
        result.elapsed_s = time.monotonic() - t0
    return result


def metric_sum(replica: Process, name: str) -> float:
    """The sum of a family's samples in a replica's /metrics (counters: the ``_total`` samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(replica.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if not s.name.endswith("_created"))
    raise KeyError(name)


def running_requests(replica: Process) -> float:
    return metric_sum(replica, "kvserve_num_requests_running")


# ---- fair throughput: cores and CPU time --------------------------------------------------------
@dataclass
class CorePlan:
    """Which cores each process of a throughput run may use: replica ``i`` gets ``replicas[i]``
    alone; the router and this client share ``others`` (None: they float over every core,
    replicas' included, which is all a 2-core machine allows)."""
    replicas: list[set[int]]
    others: set[int] | None

    def describe(self) -> str:
        reps = ", ".join(f"replica{i} -> core {','.join(map(str, sorted(c)))}" for i, c in enumerate(self.replicas))
        rest = f"cores {','.join(map(str, sorted(self.others)))}" if self.others else "any core (none left over)"
        return f"pinned: {reps}; router and client -> {rest}"


def plan_cores(replicas: int, pin: str, cores: Sequence[int] | None = None) -> CorePlan | None:
    """One core per replica when ``pin`` is ``on`` (or ``auto`` with at least ``replicas`` cores
    to this process); None (no pinning) for ``off`` or too few cores under ``auto``.

    ``cores``: the cores to use, in order (default: this process's affinity, ascending)."""
    if pin not in ("auto", "on", "off"):
        raise ValueError(f"pin must be auto, on or off, got {pin!r}")
    available = list(cores) if cores else sorted(os.sched_getaffinity(0))
    if pin == "off" or (pin == "auto" and len(available) < max(2, replicas)):
        return None
    if len(available) < replicas:
        raise ValueError(f"pinning {replicas} replicas needs {replicas} cores, got {available}")
    return CorePlan([{c} for c in available[:replicas]], set(available[replicas:]) or None)


@dataclass
class CpuUse:
    """CPU seconds a process tree used during a measured window, and the output tokens it made."""
    name: str
    cpu_s: float
    wall_s: float
    output_tokens: float = 0.0
    cores: str = "any"

    @property
    def utilization(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    def describe(self) -> str:
        tokens = f", {self.output_tokens:.0f} output tokens" if self.output_tokens else ""
        return (f"{self.name} (core {self.cores}): {self.cpu_s:.1f} s CPU in {self.wall_s:.1f} s "
                f"= {self.utilization:.0%} of one core{tokens}")


def measure_cpu(procs: Sequence[Process], run) -> tuple[object, list[CpuUse]]:  # noqa: ANN001 - run: () -> T
    """``run()``, with each process tree's CPU time, the client's (this process) and, for
    replicas, the output tokens its /metrics counted over the same window."""
    def tokens(p: Process) -> float:
        try:
            return metric_sum(p, "kvserve_generation_tokens")
        except (KeyError, httpx.HTTPError):
            return 0.0

    before = [(tree_cpu_seconds(p.proc.pid), tokens(p) if p.name.startswith("replica") else 0.0) for p in procs]
    client0, t0 = os.times(), time.monotonic()
    result = run()
    wall = time.monotonic() - t0
    client1 = os.times()
    uses = []
    for p, (cpu0, tok0) in zip(procs, before):
        cpus = sorted(os.sched_getaffinity(p.proc.pid)) if p.alive() else []
        uses.append(CpuUse(p.name, tree_cpu_seconds(p.proc.pid) - cpu0, wall,
                           tokens(p) - tok0 if p.name.startswith("replica") else 0.0,
                           ",".join(map(str, cpus)) if 0 < len(cpus) < (os.cpu_count() or 1) else "any"))
    cpus = sorted(os.sched_getaffinity(0))
    uses.append(CpuUse("client", (client1.user - client0.user) + (client1.system - client0.system), wall,
                       cores=",".join(map(str, cpus)) if len(cpus) < (os.cpu_count() or 1) else "any"))
    return result, uses


@dataclass
class FailoverResult:
    streams: int
    on_killed: float  # requests running on the killed replica when it died
    stream_errors: int  # streams that ended with an error (connection closed, error event, status)
    stream_completed: int
    hung: int  # streams still open after the deadline
    after_ok: int
    after_failed: int
    seconds_to_fail: float  # from the kill to the last erroring stream's end


def failover(router: Process, replicas: list[Process], victim: int, prompts: Sequence[str], streams: int,
             stream_tokens: int, after_requests: int, deadline_s: float = 120) -> FailoverResult:
    """Long streams through the router, SIGKILL ``replicas[victim]`` mid-stream, then more requests."""
    model = model_name(replicas[0].url)
    outcome: dict[int, str] = {}
    started = threading.Barrier(streams + 1, timeout=deadline_s)
    ended_at: dict[int, float] = {}

    def stream(k: int) -> None:
        body = {"model": model, "prompt": f"{prompts[k % len(prompts)]}Story {k}:", "max_tokens": stream_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        first = True
        try:
            with httpx.Client(base_url=router.url, timeout=httpx.Timeout(deadline_s)) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        outcome[k] = f"status {r.status_code}"
                        return
                    done = False
                    for line in r.iter_lines():
                        if first and line.startswith("data: "):
                            first = False
                            started.wait()
                        if line.startswith("data: ") and '"error"' in line:
                            outcome[k] = "error event"
                            return
                        if line == "data: [DONE]":
                            done = True
                    outcome[k] = "completed" if done else "truncated"
        except httpx.TimeoutException:
            outcome[k] = "hung"
        except (httpx.HTTPError, threading.BrokenBarrierError) as exc:
            outcome[k] = f"error {type(exc).__name__}"
        finally:
            ended_at[k] = time.monotonic()
            if first:
                try:
                    started.wait()
                except threading.BrokenBarrierError:
                    pass

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token: all are in flight
    time.sleep(0.5)
    on_killed = running_requests(replicas[victim])
    replicas[victim].kill()
    killed_at = time.monotonic()
    for t in threads:
        t.join(deadline_s + 5)
    hung = sum(1 for t in threads if t.is_alive()) + sum(1 for v in outcome.values() if v == "hung")
    errors = [k for k, v in outcome.items() if v not in ("completed", "hung")]
    after = run_prefix_workload(router.url, prompts, after_requests, max_tokens=2, concurrency=2, seed=7,
                                timeout=deadline_s, model=model)
    return FailoverResult(streams=streams, on_killed=on_killed, stream_errors=len(errors),
                          stream_completed=sum(1 for v in outcome.values() if v == "completed"), hung=hung,
                          after_ok=after.requests, after_failed=after.errors,
                          seconds_to_fail=max((ended_at[k] - killed_at for k in errors), default=0.0))


@contextmanager
def cluster(n: int, spec: ReplicaSpec, policy: str, log_dir: Path,
            cores: CorePlan | None = None) -> Iterator[tuple[Process, list[Process]]]:
    with ExitStack() as stack:
        reps = start_replicas(n, spec, log_dir, cores=cores)
        for r in reps:
            stack.callback(r.stop)
        router = start_router([r.url for r in reps], policy, log_dir, cpus=cores.others if cores else None)
        stack.callback(router.stop)
        yield router, reps


def line(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'} {text}"


@dataclass
class SmokeConfig:
    model: str | None = None
    tenants: int = 8
    prompt_tokens: int = 500
    requests: int = 64
    max_tokens: int = 2
    concurrency: int = 2
    num_blocks: int | None = None  # per replica; None: blocks_for()
    max_model_len: int = 1024
    stream_tokens: int = 800  # failover streams: long enough to be in flight at the kill
    failover: bool = True
    # cache_aware runs again (fresh tenants) while the router splits the new tenants unevenly
    placement_retries: int = 3

    def blocks_for(self, prompts: Sequence[str], block_size: int = 16) -> int:
        """KV blocks for half of the tenants' prompts (+ question and output) and the in-flight
        tails: room for a replica's share of the tenants under cache-aware routing (which splits
        equal-length prompts evenly), too little for all of them, which round-robin sends to
        every replica."""
        if self.num_blocks:
            return self.num_blocks
        from transformers import AutoTokenizer

        from engine.loader import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(self.model)[0]), local_files_only=True)
        longest = max(len(tokenizer(p).input_ids) for p in prompts) + 8 + self.max_tokens
        per_tenant = -(-longest // block_size)
        return (self.tenants // 2) * per_tenant + 2 * self.concurrency


def smoke(cfg: SmokeConfig, log_dir: Path, report=print) -> tuple[bool, dict]:
    """Two replicas; the prefix workload through a cache-aware, then a round-robin router (fresh
    tenants each time, so the first run's cache entries are merely stale LRU victims); then
    failover through the round-robin router. One PASS/FAIL line per step to ``report``."""
    blocks = cfg.blocks_for([p for seed in (0, 1) for p in tenant_prompts(cfg.tenants, cfg.prompt_tokens, seed)])
    spec = ReplicaSpec(model=cfg.model, max_model_len=cfg.max_model_len, num_blocks=blocks)
    out: dict = {"num_blocks_per_replica": blocks, "log_dir": str(log_dir)}
    ok = True
    with ExitStack() as stack:
        reps = start_replicas(2, spec, log_dir)
        for r in reps:
            stack.callback(r.stop)
        model = model_name(reps[0].url)
        even = [cfg.tenants // 2, cfg.tenants - cfg.tenants // 2]

        def served() -> list[float]:
            return [metric_sum(r, "kvserve_request_success") for r in reps]

        # cache_aware: seeds 0, 2, 3, ... (fresh tenants each attempt); round_robin: seed 1
        for policy, seeds in (("cache_aware", [0, *range(2, 2 + cfg.placement_retries)]), ("round_robin", [1])):
            for attempt, seed in enumerate(seeds):
                router = start_router([r.url for r in reps], policy, log_dir)
                try:
                    prompts = tenant_prompts(cfg.tenants, cfg.prompt_tokens, seed=seed)
                    res = run_prefix_workload(router.url, prompts, cfg.requests, cfg.max_tokens, cfg.concurrency,
                                              seed=seed, model=model, served=served)
                finally:
                    if policy == "cache_aware":
                        router.stop()
                split = sorted(res.first_round_per_replica)
                if policy == "round_robin" or split == even or attempt == len(seeds) - 1:
                    break
                # The pools hold half of the tenants each: an uneven placement (the router's own
                # choice, see run_prefix_workload) thrashes one pool whatever kvserve does.
                report(f"note: the router placed the {cfg.tenants} new tenants {split[1]}/{split[0]} over "
                       f"the replicas; again with fresh tenants")
            out[policy] = {**asdict(res), "cached_fraction": res.cached_fraction, "attempts": attempt + 1}
            target = res.cached_fraction >= 0.8 if policy == "cache_aware" else res.cached_fraction <= 0.5
            good = target and res.errors == 0 and res.requests == cfg.requests
            ok &= good
            placed = (f", tenants placed {split[1]}/{split[0]} (attempt {attempt + 1})"
                      if policy == "cache_aware" and split else "")
            report(line(good, f"{policy}: cached-token fraction {res.cached_fraction:.3f} "
                              f"({res.cached_tokens}/{res.prompt_tokens}), {res.errors} errors, {res.elapsed_s:.1f}s"
                              f"{placed} (target {'>= 0.8' if policy == 'cache_aware' else '<= 0.5'})"))
        stack.callback(router.stop)
        if cfg.failover:
            short = [f"Tenant {t}." for t in range(4)]
            fo = failover(router, reps, victim=1, prompts=short, streams=4, stream_tokens=cfg.stream_tokens,
                          after_requests=8)
            out["failover"] = asdict(fo)
            good = (fo.hung == 0 and fo.on_killed >= 1 and fo.stream_errors == fo.on_killed
                    and fo.stream_completed == fo.streams - fo.on_killed and fo.after_failed == 0)
            ok &= good
            report(line(good, f"failover: {fo.on_killed:.0f}/{fo.streams} streams on the killed replica -> "
                              f"{fo.stream_errors} errors within {max(fo.seconds_to_fail, 0):.1f}s of the kill, "
                              f"{fo.hung} hung, {fo.stream_completed} completed; after the kill "
                              f"{fo.after_ok} ok, {fo.after_failed} failed"))
    return ok, out


def throughput(model: str | None, cfg: SmokeConfig, max_tokens: int, concurrency: int, log_dir: Path,
               report=print, pin: str = "auto", cores: Sequence[int] | None = None) -> tuple[bool, dict]:
    """Output tokens/s of the prefix workload: one single-threaded replica vs two behind a cache-aware router.

    Fairness: with ``pin`` (``auto``: when this process may use at least 2 cores) each replica
    runs pinned to a core of its own (``plan_cores``), the baseline replica on the same core as
    replica0, so neither run gets more than one core per replica. Each run reports each
    replica's CPU time over the run: a replica well under 100% of its core while requests
    queue was starved (or idle), and the ratio then says more about the machine than kvserve.
    """
    plan = plan_cores(2, pin, cores)
    report(f"throughput: {plan.describe() if plan else 'not pinned (replicas, router and client share every core)'}")
    tp: dict[int, WorkloadResult] = {}
    usage: dict[int, list[CpuUse]] = {}
    prompts = tenant_prompts(cfg.tenants, cfg.prompt_tokens, seed=11)
    own_affinity = os.sched_getaffinity(0)
    try:
        if plan is not None and plan.others:
            os.sched_setaffinity(0, plan.others)  # the client: off the replicas' cores
        for n in (1, 2):
            with cluster(n, ReplicaSpec(model=model, max_model_len=cfg.max_model_len), "cache_aware",
                         log_dir, cores=plan) as (router, reps):
                url = reps[0].url if n == 1 else router.url
                name = model_name(reps[0].url)
                res, uses = measure_cpu(reps + ([router] if n == 2 else []),
                                        lambda: run_prefix_workload(url, prompts, cfg.requests, max_tokens,
                                                                    concurrency, model=name))
            tp[n], usage[n] = res, uses
            report(f"throughput: {n} replica(s){' via the router' if n == 2 else ' direct'}: "
                   f"{res.output_tokens_per_s:.1f} output tok/s ({res.completion_tokens} tokens in "
                   f"{res.elapsed_s:.1f}s, {res.errors} errors)")
            for use in uses:
                report(f"  cpu: {use.describe()}")
    finally:
        os.sched_setaffinity(0, own_affinity)
    ratio = tp[2].output_tokens_per_s / tp[1].output_tokens_per_s if tp[1].output_tokens_per_s else 0.0
    report(line(ratio >= 1.6, f"throughput: 2 replicas behind the router = {ratio:.2f}x one replica "
                              f"(target >= 1.6; {'pinned, one core each' if plan else 'not pinned'})"))
    return ratio >= 1.6, {"speedup": ratio, "pinned": plan.describe() if plan else None,
                          **{str(n): {**asdict(r), "output_tokens_per_s": r.output_tokens_per_s,
                                      "cpu": [{**asdict(u), "utilization": u.utilization} for u in usage[n]]}
                             for n, r in tp.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf file or checkpoint directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per replica (default: room for half of the tenants' prefixes)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--throughput", action="store_true", help="also measure 2 replicas + router vs 1 replica")
    ap.add_argument("--throughput-max-tokens", type=int, default=32)
    ap.add_argument("--throughput-concurrency", type=int, default=8)
    ap.add_argument("--pin", choices=["auto", "on", "off"], default="auto",
                    help="throughput: pin each replica to a core of its own (auto: when >= 2 cores are available); "
                         "the router and client get the cores left over, if any")
    ap.add_argument("--cores", type=lambda v: [int(c) for c in v.split(",")], default=None, metavar="LIST",
                    help="throughput: the cores to pin to, in order (default: this process's affinity)")
    ap.add_argument("--skip-failover", action="store_true")
    ap.add_argument("--throughput-only", action="store_true", help="skip the routing and failover steps")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvserve-scale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = SmokeConfig(model=args.model, tenants=args.tenants, prompt_tokens=args.prompt_tokens,
                      requests=args.requests, max_tokens=args.max_tokens, concurrency=args.concurrency,
                      num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                      failover=not args.skip_failover)
    report = lambda text: print(text, flush=True)  # noqa: E731
    ok, out = (True, {}) if args.throughput_only else smoke(cfg, log_dir, report)
    if args.throughput or args.throughput_only:
        _, out["throughput"] = throughput(args.model, cfg, args.throughput_max_tokens, args.throughput_concurrency,
                                          log_dir, report, pin=args.pin, cores=args.cores)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(f"logs in {log_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
