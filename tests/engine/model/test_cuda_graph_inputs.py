"""The device-independent parts of the GPU step: graph buckets, padded decode inputs and
the KV budget arithmetic (the capture and the measurement run in tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from engine.model.cuda_graphs import build_decode_inputs, bucket_for, graph_batch_sizes
from engine.kv.budget import GpuMemoryProfile, kv_budget_bytes


def test_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_for():
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert bucket_for(65, sizes) is None


def test_padded_inputs_point_at_the_sink():
    # rows: position 5 in blocks [7, 3] (slot 3*4+1), position 0 in block [9]; bucket 4, sink 20
    inputs = build_decode_inputs([11, 12], [5, 0], [[7, 3, 99], [9]], bucket=4, width=3, block_size=4,
                                 sink_block=20)
    assert inputs.input_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [5, 0, 0, 0]
    assert inputs.seq_lens.tolist() == [6, 1, 1, 1]
    assert inputs.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4, 80, 80]
    # only the blocks a row uses are copied (99 is past position 5); the rest is the sink
    assert inputs.block_table.tolist() == [[7, 3, 20], [9, 20, 20], [20] * 3, [20] * 3]


def test_padded_inputs_reuse_buffers_and_check_sizes():
    buf = build_decode_inputs([1] * 4, [0] * 4, [[5]] * 4, bucket=4, width=2, block_size=4, sink_block=8)
    again = build_decode_inputs([2], [4], [[5, 6]], bucket=2, width=2, block_size=4, sink_block=8, out=buf)
    assert again is buf and buf.input_ids[:2].tolist() == [2, 0] and buf.block_table[1].tolist() == [8, 8]
    assert buf.input_ids[2:].tolist() == [1, 1]  # rows past the bucket are not read
    with pytest.raises(ValueError, match="do not fit"):
        build_decode_inputs([1] * 3, [0] * 3, [[1]] * 3, bucket=2, width=2, block_size=4, sink_block=8)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        build_decode_inputs([1], [8], [[1, 2, 3]], bucket=1, width=2, block_size=4, sink_block=8)


def test_kv_budget():
    gib = 2 ** 30
    assert kv_budget_bytes(100 * gib, 20 * gib, 5 * gib, 0.9, gib) == 64 * gib
    assert kv_budget_bytes(10 * gib, 9 * gib, gib, 0.9, gib) == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(gib, 0, 0, 1.5, 0)
    profile = GpuMemoryProfile(total=141 * gib, used=17 * gib, activation_peak=2 * gib, utilization=0.9,
                               reserve=gib)
    assert "141.0 GiB total" in profile.describe() and profile.kv_budget == int(141 * gib * 0.9) - 20 * gib


def test_padded_decode_path_matches_transformers():
    """The bucketed decode inputs (padding rows on the sink block, fixed split plan) run
    eagerly on the CPU through the triton kernels: logits equal transformers'."""
    pytest.importorskip("triton")
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config
    from tests.engine.model.test_model_vs_transformers import GREEDY, LogitRecorder, check_against_hf

    hf = tiny_hf_model(tiny_llama_config(num_hidden_layers=1, max_position_embeddings=64))
    engine = tiny_engine(hf, num_blocks=40, attention_backend="triton")
    runner = engine.runner
    assert runner.kv_caches[0][0].shape[0] == 41 and runner.sink_block == 40  # the sink is not the manager's
    runner.graphs = runner.padded_decode_runner(max_num_seqs=4, max_model_len=engine.max_model_len)
    calls = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda *a: calls.append(len(a[0])) or real_run(*a)
    recorder = LogitRecorder(engine)
    engine.generate([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], GREEDY)
    assert calls and set(calls) == {3}  # three decode rows, padded to the bucket of 4
    assert check_against_hf(hf, recorder) == 3 * 6
    assert runner.kv_caches[0][0][40].abs().sum() > 0  # the padding row wrote into the sink block


def test_profile_run_fits_its_pool():
    """The profiling pass (run on the GPU before sizing the pool) plans the largest step the
    scheduler may: all its blocks fit ``profile_blocks`` and every sequence samples."""
    from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

    engine = tiny_engine(tiny_hf_model(tiny_llama_config(num_hidden_layers=1)), attention_backend="torch")
    runner = engine.runner
    assert runner.profile_blocks(64, 5) == 5 * 4  # 12 or 16 tokens per sequence, blocks of 4
    runner.allocate_kv(runner.profile_blocks(64, 5))
    seen = []
    runner.sampler = lambda logits, rows: seen.append(logits.shape) or type("O", (), {
        "token_ids": [0] * len(rows), "logprobs": None, "top_logprobs": None})()
    runner.profile_run(64, 5)
    assert seen == [torch.Size([5, 128])] and runner.num_tokens_computed == 0
