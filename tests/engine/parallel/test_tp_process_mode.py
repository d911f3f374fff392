"""Tensor parallelism in the served default, process mode: a real ``kvserve serve`` with
``--tensor-parallel-size 2`` (gloo, 1 thread a rank) on a tiny random Llama, driven through the
``openai`` SDK.

The engine core process is rank 0 and spawns rank 1. Checked here, in order, on one server:

1. greedy tokens equal TP=1's (an in-process single-rank engine on the same weights);
2. ``kill -9`` of the core ends rank 1 too (no orphan), the server serves again, with a new
   core and a new rank 1, and the same greedy tokens;
3. ``kill -9`` of the frontend leaves neither the core nor rank 1 behind.

(A dead rank ending its engine is checked in process by test_tensor_parallel.py: each restart
here costs a core and a rank start, seconds of imports each.)

The synthetic word-level tokenizer writes token ``i`` as the word ``t<i>``, so the completion
text gives back the exact token ids.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from bench.gpu_check import synthetic_tokenizer
from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
from tests.server.conftest import start_server_process, stop_server_process, wait_healthy

VOCAB = 131  # 66 LM-head rows a rank, one of them padding
PROMPTS = [[5, 9, 17, 33, 64, 100], [7, 7, 7, 120, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54,
                                                          55, 56, 57, 58, 59]]
MAX_TOKENS = 12
START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(tiny_llama_config(vocab_size=VOCAB, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def expected(hf) -> list[list[int]]:
    """TP=1's greedy tokens, in process, on the same weights."""
    engine = tiny_engine(hf, block_size=16)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def server(hf, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tiny-tp")
    hf.save_pretrained(str(ckpt), safe_serialization=True)
    synthetic_tokenizer(VOCAB).save_pretrained(str(ckpt))
    srv = start_server_process(tmp_path_factory.mktemp("tp-logs"), "--model", str(ckpt), "--tensor-parallel-size", "2", "--engine-mode", "process",
                               "--max-model-len", "256", "--kv-cache-memory", "0.01", "--block-size", "16")
    try:
        wait_healthy(srv.base_url, START_TIMEOUT_S, srv.proc)
        yield srv
    finally:
        stop_server_process(srv)


def greedy(srv) -> list[list[int]]:
    import openai

    with openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        out = []
        for prompt in PROMPTS:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].finish_reason == "length"
            out.append([int(w[1:]) for w in r.choices[0].text.split()])
    return out


def group_pids(srv) -> tuple[int, int]:
    """(core pid, rank 1 pid) of the latest core, from the server's log."""
    log = srv.log()
    cores = re.findall(r"engine core process started \(pid (\d+)\)", log)
    ranks = re.findall(r"rank pids \[(\d+)\]", log)
    assert cores and ranks, log[-3000:]
    return int(cores[-1]), int(ranks[-1])


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_restarted(srv, old_core: int) -> tuple[int, int]:
    """Wait for /health 200 from a new core; its (core, rank 1) pids."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log()[-3000:]
        try:
            ok = httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and group_pids(srv)[0] != old_core:
            return group_pids(srv)
        time.sleep(0.2)
    raise AssertionError("the server did not serve again after the core died:\n" + srv.log()[-3000:])


def test_tp2_process_mode_equals_tp1(server, expected):
    core, rank1 = group_pids(server)
    assert parent(rank1) == core and parent(core) == server.proc.pid  # the core is rank 0 and spawned rank 1
    assert "2 ranks over gloo" in server.log()
    assert greedy(server) == expected


def test_killing_the_core_ends_its_ranks_and_the_server_recovers(server, expected):
    core, rank1 = group_pids(server)
    os.kill(core, signal.SIGKILL)
    assert wait_gone([rank1], 5.0) == [], "rank 1 outlived the killed core"
    new_core, new_rank1 = wait_restarted(server, core)
    assert new_rank1 != rank1 and alive(new_rank1) and parent(new_rank1) == new_core
    assert greedy(server) == expected


def test_killing_the_frontend_leaves_no_rank_behind(server):
    core, rank1 = group_pids(server)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    assert wait_gone([core, rank1], 15.0) == []
