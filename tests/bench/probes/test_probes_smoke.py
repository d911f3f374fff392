"""The probes' core functions run end to end on a tiny random Llama (no timing asserts: a verdict
is checked against its own measured ratio and target, not against a speed)."""
from __future__ import annotations

import pytest
import torch

from bench.probes.engine_vs_hf import BATCH_TARGET, SINGLE_TARGET, run_engine_vs_hf
from bench.probes.serving_vs_hf import STATIC_TARGET, run_serving_vs_hf
from bench.workload import chat_prompts, make_requests
from tests.helpers import tiny_engine, tiny_hf_model


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_model()
    return tiny_engine(hf, num_blocks=256), hf


def test_engine_vs_hf_smoke(pair):
    engine, hf = pair
    vocab = hf.config.vocab_size
    single = chat_prompts(None, 2, offset=1, vocab_size=vocab, length=8)
    batch = chat_prompts(None, 4, offset=3, vocab_size=vocab, length=10)
    result = run_engine_vs_hf(engine, hf, single, batch, single_new_tokens=4, batch_new_tokens=4,
                              bandwidth_mib=16)
    s, b = result["single_stream"], result["batch"]
    assert s["kvserve_decode_tps"] > 0 and s["hf_decode_tps"] > 0
    assert b["kvserve_tps"] > 0 and b["hf_tps"] > 0
    assert s["ratio"] > 0 and b["ratio"] > 0
    # each verdict is its measured ratio against the probe's target
    assert s["ratio"] == pytest.approx(s["kvserve_decode_tps"] / s["hf_decode_tps"], rel=0.02)
    assert b["ratio"] == pytest.approx(b["kvserve_tps"] / b["hf_tps"], rel=0.02)
    assert (s["target"], b["target"]) == (SINGLE_TARGET, BATCH_TARGET)
    assert s["verdict"] == ("PASS" if s["ratio"] >= SINGLE_TARGET else "FAIL")
    assert b["verdict"] == ("PASS" if b["ratio"] >= BATCH_TARGET else "FAIL")
    assert s["token_match"] == "2/2"  # greedy tokens equal transformers'
    bw = result["bandwidth"]
    assert bw["read_gbs"] > 0 and bw["bound_tps"] > 0 and 0 < bw["kvserve_fraction"]
    assert not engine.has_unfinished()


def test_serving_vs_hf_smoke(pair):
    engine, hf = pair
    requests = make_requests(4, prompt_len=(5, 20), output_len=(2, 6), vocab_size=hf.config.vocab_size, seed=1,
                             low_token_id=3)
    result = run_serving_vs_hf(engine, hf, requests, hf_batch_size=2)
    expected = sum(r.output_len for r in requests)
    assert result["workload"]["output_tokens"] == expected
    assert result["kvserve"]["output_tokens"] == expected and result["kvserve"]["tps"] > 0
    assert result["hf_static"]["output_tokens"] == expected and result["hf_static"]["tps"] > 0
    ratio = result["ratio_vs_static"]
    assert ratio == pytest.approx(result["kvserve"]["tps"] / result["hf_static"]["tps"], rel=0.02)
    assert result["target_vs_static"] == STATIC_TARGET
    assert result["verdict_vs_static"] == ("PASS" if ratio >= STATIC_TARGET else "FAIL")
    cb = result["hf_continuous"]
    if "skipped" in cb:  # allowed, but never silent: the reason is in the result
        assert cb["skipped"] and result["verdict_vs_continuous"] == "SKIPPED"
    else:
        assert cb["output_tokens"] == expected and cb["tps"] > 0
        assert result["ratio_vs_continuous"] > 0
    assert not engine.has_unfinished()


def test_spec_decode_probe_matches_plain_greedy():
    from bench.probes.spec_decode import copy_prompts, run_spec_decode

    hf = tiny_hf_model()
    engine = tiny_engine(hf, num_blocks=256)
    prompts = copy_prompts(None, 128, 2)  # a repeated passage: drafts get proposed and accepted
    # every draft verified (the adaptive rule off): the probe's mechanics, not the rule, are under test
    result = run_spec_decode(engine, {"copy": prompts}, new_tokens=16, k=3, verify_cost_ratio=0)
    copy = result["classes"]["copy"]
    assert copy["token_match"] == "2/2"
    assert copy["draft_tokens"] > 0 and copy["accepted_tokens"] > 0
    assert engine.scheduler.config.speculative_config is None and not engine.has_unfinished()


def test_quant_linear_bench_smoke():
    import gguf
    import numpy as np

    from bench.probes.quant_linear import run_quant_linear
    from engine.loader.gguf.blocks import BlockFormat, GGUFMatrix
    from tests.helpers import require_native_kernel

    require_native_kernel()
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q4_1)
    matrix = GGUFMatrix(torch.from_numpy(raw), BlockFormat.Q4_1, 64).pack()
    result = run_quant_linear({"tiny": [matrix, matrix]}, rows=[1, 5], min_s=0.01)
    assert [r["rows"] for r in result["results"]] == [1, 5]
    for r in result["results"]:
        assert r["shape"] == [40, 64] and r["format"] == "Q4_1"
        assert r["block_us"] > 0 and r["onednn_us"] > 0 and r["mkl_us"] > 0 and r["onednn_over_block"] > 0
        assert (r["bf16_us"] is not None) == torch.ops.kvserve.gguf_linear_bf16_supported()
    int8 = run_quant_linear({"tiny": [matrix]}, rows=[4], min_s=0.01, int8=True)["results"][0]
    assert int8["format"] == ("Q4_1 int8" if torch.ops.kvserve.gguf_q8_supported(int(BlockFormat.Q4_1)) else "Q4_1")


def test_step_profile_times_every_piece_of_a_step(pair):
    from bench.probes.step_profile import profile

    engine, _ = pair
    rows = profile(engine, [1, 3], prompt_len=6, tokens=5)
    for row in rows:
        assert row["steps"] == 5  # one prefill step, then one decode step per further token
        pieces = row["pieces"]
        for label in ("model forward", "LM head", "sampler", "prepare inputs", "schedule", "scheduler update"):
            assert pieces[label][1] == 5, (label, pieces)
        assert 0 < pieces["LM head"][0] < row["step_ms"] and pieces["model forward"][0] < row["step_ms"]
    engine.kv_cache.check_invariants()


def test_gpu_step_probe_profiles_each_batch():
    """The GPU step probe on bench.gpu_check's tiny config on the CPU: one profile per batch, the
    kernel table names the model's matmuls and the host table the engine's step."""
    from bench.probes.gpu_step import main

    rows = main(["--tiny", "--device", "cpu", "--batches", "1", "3", "--prompt-len", "12"])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["wall_ms"] > 0 and r["device_ms"] == 0  # no CUDA activity on the CPU
        assert "aten::mm" in r["kernels"] or "aten::addmm" in r["kernels"], r["kernels"]
        assert "step" in r["host"]


def test_spec_decode_probe_concurrent_streams_with_the_suffix_method():
    from bench.probes.spec_decode import copy_prompts, run_spec_decode

    engine = tiny_engine(tiny_hf_model(), num_blocks=256)
    prompts = copy_prompts(None, 128, 2)
    result = run_spec_decode(engine, {"copy": prompts}, new_tokens=12, k=3, verify_cost_ratio=0, method="suffix",
                             streams=4)
    copy = result["classes"]["copy"]
    assert (result["method"], result["streams"], copy["prompts"], copy["token_match"]) == ("suffix", 4, 4, "4/4")
    assert copy["output_tokens"] == 4 * 12 and copy["accepted_tokens"] > 0
    assert engine.scheduler.config.speculative_config is None and not engine.has_unfinished()


def test_attention_pool_smoke():
    """The attention probe's arithmetic: its pool bytes are K and V of every row, token and layer,
    its rate those bytes over its own median round, and each row's table covers its context with
    distinct blocks (half contiguous, half interleaved)."""
    from bench.probes.attention_pool import KV_HEADS, HEAD_DIM, block_tables, run_attention_pool
    from tests.helpers import require_native_kernel

    require_native_kernel()
    tables = block_tables(3, 4)
    assert tables.tolist() == [[0, 1, 6, 9], [2, 3, 7, 10], [4, 5, 8, 11]]
    r = run_attention_pool(rows=3, context=40, layers=2, sweep_mib=1, rounds=2, block_size=16)
    assert r["pool_bytes"] == 2 * 2 * 3 * 40 * KV_HEADS * HEAD_DIM * 2  # fp16
    assert r["read_gbs_p50"] == pytest.approx(r["pool_bytes"] / (r["p50_ms"] / 1000) / 1e9)
    assert 0 < r["min_ms"] <= r["p50_ms"]


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 2e-2), ("float32", 1e-5)])
def test_prefill_attention_probe_smoke(dtype, tolerance):
    """The prefill attention probe times both paths on the same inputs, and they agree within the
    chunk dtype's rounding of the output (bf16: torch's path rounds it; the kernel does not)."""
    from engine.attention.native import native_prefill_runs
    from tests.helpers import require_native_kernel

    require_native_kernel()
    if not native_prefill_runs(64, getattr(torch, dtype)):
        pytest.skip(f"no {dtype} prefill kernel on this CPU")
    from bench.probes.prefill_attention import run_prefill_attention

    r = run_prefill_attention(queries=20, prefix=50, rounds=5, dtype=dtype)
    assert (r["dtype"], r["queries"], r["prefix"]) == (dtype, 20, 50)
    assert r["kvserve_ms"] > 0 and r["torch_ms"] > 0
    # the speedup comes from the unrounded times (2 decimals); the ms are rounded to 0.001, which at
    # ~0.02 ms is ~2.5%: the ratio of the rounded times may differ by that much, and no more
    rounding = 0.0005 / r["kvserve_ms"] + 0.0005 / r["torch_ms"]
    assert r["speedup"] == pytest.approx(r["torch_ms"] / r["kvserve_ms"], rel=rounding + 0.002, abs=0.005)
    assert r["max_abs_diff"] < tolerance


def test_prefill_rows_probe_smoke():
    """The row-ops probe times both bindings of each op on the same inputs, which agree within fp32
    rounding; its prefill A/B leaves the engine's binding as it found it."""
    from tests.helpers import require_native_kernel

    require_native_kernel()
    from bench.probes.prefill_rows import run_prefill_ab, run_row_ops

    r = run_row_ops(rows=9, hidden=128, heads=3, rounds=5)
    for op in ("rms_norm", "add_rms_norm", "rope"):
        assert r[op]["native_us"] > 0 and r[op]["torch_us"] > 0 and r[op]["max_abs_diff"] < 1e-4, (op, r[op])
    engine = tiny_engine(tiny_hf_model(), num_blocks=64)
    ab = run_prefill_ab(engine, tokens=20, rounds=2)
    assert len(ab["native"]["runs_ms"]) == len(ab["torch"]["runs_ms"]) == 2
    assert engine.runner.model.native_rows and not engine.has_unfinished()


def test_chunk_path_smoke():
    """Each side runs a prefix hit's step as forced (through NativeDecoder's limits, which the
    probe restores, as it does the method it watches); the rows and pairs are the uncached tail's.
    The tiny model's head size (16) is not the tiles': no tiles side."""
    from bench.probes.chunk_path import compare_chunk_paths

    engine = tiny_engine(tiny_hf_model(), block_size=4, num_blocks=256)
    native = engine.runner.model.native
    limits = (native.max_chunk_attention, native.tiles_step_rows, native.chunk_tiles)
    rows = compare_chunk_paths(engine, contexts=[10], news=[1, 2], rounds=2)
    assert [(r["rows"], r["pairs"]) for r in rows] == [(3, 3 * 11), (4, 4 * 12)]  # 10 % 4 = 2 uncached
    assert all(r["as_forced"] for r in rows)  # within the dense model's max_rows (4)
    assert all(r["kernel_ms"] > 0 and r["python_ms"] > 0 and r["tiles_ms"] is None for r in rows)
    assert compare_chunk_paths(engine, contexts=[10], news=[5], rounds=2)[0]["as_forced"] is False  # 7 rows > 4
    assert all(r["rule"] == "native" for r in rows)  # few pairs: the native path's
    assert (native.max_chunk_attention, native.tiles_step_rows, native.chunk_tiles) == limits
    assert "rows" not in vars(native)
    engine.kv_cache.check_invariants()
    assert not engine.has_unfinished() and engine.kv_cache.usage == 0  # every block back
