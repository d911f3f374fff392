"""Tensor parallelism on CPU: TP=2 (gloo, 2 processes) gives TP=1's greedy tokens, with prefix
caching and preemption in play, on a tiny random Llama (GQA, a vocabulary that does not split
evenly, so the last LM-head slice is padded)."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from cache import CacheConfig
from engine.config import ModelConfig
from engine.kv.int8 import Int8KV
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.model.arch import ModelArch
from engine.model.llama import LlamaForCausalLM
from engine.model.parallel_linear import RowParallelLinear
from engine.parallel.tensor_parallel import shard_arch, shard_state_dict
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from tests.helpers import tiny_hf_model, tiny_llama_config

# 4 query heads, 2 KV heads, vocab 131 (66 rows per rank, one of them padding).
CONFIG = dict(vocab_size=131, num_attention_heads=4, num_key_value_heads=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def engine(hf, tp: int, attention_backend: str = "auto", kv_cache_dtype: str = "float32", **cache_options) -> LLMEngine:
    """``auto``: the native decode kernel where it builds (each rank runs it on its own heads).
    KV float32 by default, the exact flag (one rank's CPU default would be fp16, which the ranks
    do not implement): the tests compare one rank with two token for token."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    loaded = LoadedModel(path=None, name="tiny-llama", hf_config=hf.config,
                         arch=ModelArch.from_hf_config(hf.config), state_dict=state, tokenizer=None)
    # 14 blocks of 4 tokens cannot hold the batch below at once: requests get preempted.
    return LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=1, attention_backend=attention_backend, tensor_parallel_size=tp,
                          device="cpu"),
        cache=CacheConfig(block_size=4, num_blocks=14, kv_cache_dtype=kv_cache_dtype,
                          **{"enable_prefix_caching": True, **cache_options}),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)), loaded)


def workload() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 131) for _ in range(12)]  # three full blocks every prompt shares
    return [shared + [rng.randrange(3, 131) for _ in range(rng.randint(2, 6))] for _ in range(4)]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(tiny_llama_config(**CONFIG))


def test_shards_cover_the_weights(hf):
    arch = ModelArch.from_hf_config(hf.config)
    sd = hf.state_dict()
    local = shard_arch(arch, 2)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (2, 1, 66)
    parts = [shard_state_dict(sd, arch, r, 2) for r in range(2)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([p[q] for p in parts]), sd[q])
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([p[down] for p in parts], dim=1), sd[down])
    emb = torch.cat([p["model.embed_tokens.weight"] for p in parts])
    assert torch.equal(emb[:131], sd["model.embed_tokens.weight"]) and not emb[131:].any()
    with pytest.raises(ValueError, match="must divide"):
        shard_arch(arch, 3)


def test_tp2_equals_tp1_with_prefix_caching_and_preemption(hf):
    ps = workload()
    one = engine(hf, 1)
    expected = one.generate(ps, PARAMS)
    two = engine(hf, 2)
    try:
        # One model class and one decoder layer: rank 0's model is the single-rank one, its
        # row-parallel matmuls all-reducing (engine/model/parallel_linear.py).
        model = two.runner.model
        assert type(model) is type(one.runner.model) is LlamaForCausalLM
        assert all(isinstance(layer.o_mm, RowParallelLinear) and isinstance(layer.down_mm, RowParallelLinear)
                   for layer in model.layers)
        assert not isinstance(one.runner.model.layers[0].o_mm, RowParallelLinear)
        assert model.decode_path == "python"  # the native path does not cover tensor parallel ranks
        got = two.generate(ps, PARAMS)
        # Rank 0's pool holds its own KV head only.
        assert two.runner.kv_caches[0][0].shape[2] == 1 and one.runner.kv_caches[0][0].shape[2] == 2
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        for e in (one, two):
            assert e.scheduler.stats.num_preemptions > 0, "the workload must preempt"
            assert e.scheduler.stats.prefix_cache_hits > 0, "the workload must hit the prefix cache"
        assert sum(r.num_cached_tokens for r in got) == sum(r.num_cached_tokens for r in expected) > 0
        # A second round reuses the cached prefix blocks on both ranks.
        again = two.generate(ps[:2], PARAMS)
        assert [r.token_ids for r in again] == [r.token_ids for r in expected[:2]]
        assert all(r.num_cached_tokens >= 12 for r in again)
        assert two.kv_cache.usage == 0
        # A rank that dies breaks the group for good: its owner hears of it (the core process
        # exits on it, and its client starts a new core and group).
        lost: list[tuple[int, int | None]] = []
        heard = threading.Event()
        assert two.watch_ranks(lambda rank, code: (lost.append((rank, code)), heard.set()))
        proc = two.runner.model.ranks.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        assert heard.wait(10) and lost[0][0] == 1
        # While a killed rank is still exiting, is_alive() can say True after its sentinel is
        # ready; close must not broadcast "stop" into the broken group then (such a broadcast
        # had blocked a full suite run for good).
        sent: list[tuple] = []
        proc.is_alive = lambda: True
        two.runner.model.ranks._broadcast = sent.append
        two.close()
        del proc.is_alive
        assert sent == []
    finally:
        two.close()
    assert all(not p.is_alive() for p in two.runner.model.ranks.procs)
    assert not one.watch_ranks(lambda rank, code: None)  # a single rank: nothing to watch


def test_tp2_int8_kv_equals_tp1_int8_kv(hf):
    """``--kv-cache-dtype int8`` with two ranks: every rank holds int8 pools for its own KV heads
    (they used to build float pools on ranks 1..N-1 whatever rank 0 had), so greedy tokens and
    logprobs equal one rank's int8 run, through prefix hits and preemption; and they differ from
    the float-KV run (the int8 path really ran on every rank)."""
    ps = workload()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    expected = engine(hf, 1, kv_cache_dtype="int8").generate(ps, params)
    float_kv = engine(hf, 1).generate(ps, params)
    two = engine(hf, 2, kv_cache_dtype="int8")
    try:
        got = two.generate(ps, params)
        k0 = two.runner.kv_caches[0][0]
        assert isinstance(k0, Int8KV) and k0.shape[2] == 1  # rank 0: its own KV head, int8
        assert two.scheduler.stats.num_preemptions > 0 and two.scheduler.stats.prefix_cache_hits > 0
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        deltas = [abs(a.logprob - b.logprob) for r, e in zip(got, expected) for a, b in zip(r.logprobs, e.logprobs)]
        assert max(deltas) < 1e-4, max(deltas)
        to_float = [abs(a.logprob - b.logprob) for r, e in zip(got, float_kv) for a, b in zip(r.logprobs, e.logprobs)]
        assert max(to_float) > 10 * max(deltas)
        two.kv_cache.check_invariants()
        assert two.kv_cache.usage == 0
    finally:
        two.close()


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_tp2_kv_tiers_carry_every_ranks_heads(hf, tmp_path, kv_cache_dtype):
    """The host and disk tiers with two ranks: a block's payload gathers both ranks' KV heads in
    the single-rank layout, so a TP=2 engine restarted on a TP=1 engine's disk folder serves the
    prefix from disk, and after the pool evicts it again from the host tier (promoted there),
    with one rank's tokens and logprobs each time. (They used to copy rank 0's heads only: the
    other rank's restored blocks were stale and greedy tokens went wrong.)"""
    p = [random.Random(5).randrange(3, 131) for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    seed = engine(hf, 1, kv_cache_dtype=kv_cache_dtype, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    seed.generate([p], params)
    # One rank reading the same 28 cached tokens from its pool (int8: a fresh prompt attends to
    # its unquantized K/V, a cached prefix to the quantized blocks, so compare like with like).
    reference = seed.generate([p], params)[0]
    assert reference.num_cached_tokens == 28
    single_payload = seed.offloader.copier.payload_bytes
    seed.close()  # spills the pool to disk
    two = engine(hf, 2, kv_cache_dtype=kv_cache_dtype, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01,
                 kv_offload_gib=64 * single_payload / 2**30)
    try:
        assert two.offloader.copier.payload_bytes == single_payload
        runs = [two.generate([p], params)[0]]
        two.generate([[random.Random(6 + i).randrange(3, 131) for _ in range(40)] for i in range(3)],
                     SamplingParams(temperature=0.0, max_tokens=2))
        assert two.kv_cache.get_computed_blocks(p)[1] == 0  # gone from the pool
        runs.append(two.generate([p], params)[0])
        stats = two.scheduler.stats
        assert stats.tier_hits["disk"] == 28 and stats.tier_hits["host"] == 28
        for run in runs:
            assert run.num_cached_tokens == 28
            assert run.token_ids == reference.token_ids
            assert max(abs(a.logprob - b.logprob) for a, b in zip(run.logprobs, reference.logprobs)) < 1e-4
        two.kv_cache.check_invariants()
        assert two.kv_cache.usage == 0
    finally:
        two.close()


def test_refusals(hf):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelConfig(tensor_parallel_size=0)


def test_step_messages_move_to_a_rank_device():
    """What rank 0 broadcasts (ids, positions, the attention metadata's nested dataclasses) is moved
    whole to another device (CUDA ranks: to the CPU to pickle, then to ``cuda:r``); the meta device
    stands in for a GPU here, and nothing is copied when nothing has to move."""
    from engine.attention.metadata import AttentionMetadata, DecodeGroup, PagedLayout, PrefillChunk
    from engine.parallel.comm import backend_for
    from engine.parallel.tensor_parallel import rank_device, to_device

    long = torch.arange(4)
    meta = AttentionMetadata(slot_mapping=long, decode_groups=[DecodeGroup(0, 1, 3, long, None, long[:1])],
                             prefills=[PrefillChunk(1, 4, 3, long, torch.ones(3, 3, dtype=torch.bool))],
                             paged=PagedLayout(long.int(), long.int(), long.int().view(2, 2), 1, 3, 4))
    msg = ("forward", long, long, meta, (5, 16, 1, 16), False)  # pool shape, int8
    assert to_device(msg, torch.device("cpu")) is msg
    moved = to_device(msg, torch.device("meta"))
    tensors = [moved[1], moved[3].slot_mapping, moved[3].decode_groups[0].block_ids,
               moved[3].decode_groups[0].context_lens, moved[3].prefills[0].mask, moved[3].paged.block_table]
    assert all(t.device.type == "meta" for t in tensors)
    assert moved[3].decode_groups[0].mask is None and moved[3].paged.num_decodes == 1 and moved[4] == (5, 16, 1, 16)
    assert moved[3].paged.block_table.shape == (2, 2) and moved[3].paged.block_table.dtype == torch.int32
    assert meta.slot_mapping.device.type == "cpu"  # the original is untouched
    # NCCL for CUDA ranks, each on its own GPU; gloo and the CPU otherwise.
    assert backend_for(torch.device("cuda", 1)) == "nccl" and backend_for(torch.device("cpu")) == "gloo"
    assert rank_device("cuda", 1) == torch.device("cuda", 1) and rank_device("cpu", 1) == torch.device("cpu")


def test_a_rank_that_dies_at_start_fails_the_launch_at_once():
    """Rank 0 waits for each rank's ready key, and a rank that exits first fails the start with its
    exit code instead of a wait until the store's timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.parallel.tensor_parallel import wait_for_ranks

    class Proc:  # a rank process: alive until ``exitcode`` is set
        def __init__(self) -> None:
            self.exitcode: int | None = None

        def is_alive(self) -> bool:
            return self.exitcode is None

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ready, dead = Proc(), Proc()
    store.set("ready/1", "1")
    dead.exitcode = 3
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 exited with code 3"):
        wait_for_ranks(store, [ready, dead], timeout_s=30)
    assert time.monotonic() - t0 < 5
    store.set("ready/2", "1")
    wait_for_ranks(store, [ready, dead], timeout_s=30)  # ready keys set: no wait, dead or not
    with pytest.raises(RuntimeError, match="rank 1 was not ready within 0s"):
        wait_for_ranks(dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False), [Proc()], 0)
