"""The decode step's roofline pieces of ``bench.roofline`` at tiny sizes: the bound's arithmetic,
the matmul inventory against the model's shape, the per-step breakdown's structure, and that
profiling leaves the engine as it was."""
from __future__ import annotations

import pytest
import torch

from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel

SHAPE = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny Q4_K_M-mix GGUF (Q4_K, and Q6_K where llama-quantize's rule puts it) served from its
    blocks with int8 activations, as the CPU defaults serve a GGUF."""
    require_native_kernel()
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    path = write_gguf(tmp_path_factory.mktemp("roofline") / "mix.gguf", SHAPE, q4_k_m, seed=7)
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), num_threads=1, weights_resident="blocks", activation_quant="int8"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16)))


def test_step_bound_arithmetic():
    from bench.roofline import MatmulGroup, step_bound

    groups = [MatmulGroup("gguf_linear_q8", "Q4_1", 1_000_000), MatmulGroup("dense", "fp32", 500_000)]
    peaks = {"gguf_linear_q8:Q4_1": 1.0, "dense:fp32": 0.5}  # GOP/s
    # 2 MB at 1 GB/s: 2 ms; 4 rows: 2 x 4 x 1e6 ops at 1 GOP/s (8 ms) + 2 x 4 x 5e5 at 0.5 (8 ms)
    b = step_bound(groups, 2_000_000, 1.0, peaks, rows=4)
    assert b["bytes_ms"] == pytest.approx(2.0) and b["compute_ms"] == pytest.approx(16.0)
    assert b["bound_ms"] == pytest.approx(16.0) and b["bound_by"] == "compute"
    b1 = step_bound(groups, 2_000_000, 1.0, peaks, rows=1)
    assert b1["compute_ms"] == pytest.approx(4.0) and b1["bound_ms"] == pytest.approx(4.0)
    assert step_bound(groups, 20_000_000, 1.0, peaks, rows=1)["bound_by"] == "bandwidth"


def test_kernel_peak_and_isa():
    require_native_kernel()
    from bench.roofline import isa_report, kernel_peak_gops
    from engine.loader.gguf.blocks import BlockFormat

    for op in ("gguf_linear_q8", "gguf_linear"):
        assert kernel_peak_gops(op, BlockFormat.Q8_0, rows=4, out_features=64, in_features=256, min_s=0.01) > 0
    isa = isa_report()
    assert isa["kernel_q8_isa"] == torch.ops.kvserve.gguf_q8_isa()
    # the kernel never takes AMX tiles the OS does not show
    assert not isa["kernel_amx"] or all(isa["amx_cpuinfo"][f] for f in ("amx_tile", "amx_int8"))


def test_decode_matmuls_cover_the_model(engine):
    from bench.roofline import decode_matmuls

    groups = decode_matmuls(engine.runner.model)
    s = SHAPE
    q, kv = s.hidden, s.kv_heads * s.head_dim
    per_layer = s.hidden * (q + 2 * kv) + s.hidden * s.hidden + 3 * s.ffn * s.hidden
    assert sum(g.macs_per_row for g in groups) == s.layers * per_layer + s.vocab * s.hidden
    assert {g.fmt for g in groups} <= {"Q4_K", "Q6_K"} and "Q4_K" in {g.fmt for g in groups}
    assert all(g.op == "gguf_linear_q8" for g in groups)  # int8 activations on every K-quant block


def test_flops_per_token_of_a_blocks_only_gguf(engine):
    """The roofline's FLOPs per token count the GGUF's matmuls, not the torch parameters, which a
    model served from its blocks alone (no dense copy) has next to none of."""
    from bench.roofline import decode_flops_per_token

    s = SHAPE
    kv = s.kv_heads * s.head_dim
    macs = s.layers * (s.hidden * (2 * s.hidden + 2 * kv) + 3 * s.ffn * s.hidden) + s.vocab * s.hidden
    assert decode_flops_per_token(engine.runner.model) == 2 * macs
    assert sum(p.numel() for p in engine.runner.model.layers.parameters()) < macs // 100


def test_roofline_gguf_choice(tmp_path):
    """``bench roofline --gguf``: the default model for none or the shipped Q4_1, a named file, or
    an existing .gguf path; anything else is refused with the choices."""
    from bench.__main__ import build_parser, roofline_model

    tiny = write_gguf(tmp_path / "tiny.gguf", SHAPE, q4_k_m, seed=3)
    assert roofline_model(None) is None and roofline_model("Q4_1") is None
    assert roofline_model(str(tiny)) == tiny
    for bad in (str(tmp_path / "missing.gguf"), str(tmp_path), "Q5_K_S"):
        with pytest.raises(ValueError, match="random-1b-Q4_K_M"):
            roofline_model(bad)
    assert build_parser().parse_args(["roofline", "--gguf", str(tiny)]).gguf == str(tiny)


def test_step_roofline_breakdown(engine):
    from bench.roofline import step_roofline, step_tables
    from bench.step_timing import top_level

    model = engine.runner.model
    prompt = [5 + i for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = engine.generate([prompt], params)[0].token_ids
    step = step_roofline(engine, (1, 4), prompt_len=12, tokens=6, repeats=1, kernel_min_s=0.01, peak_rows=8)

    assert step["model_bandwidth_gbs"] > 0 and step["weight_bytes"] == model.decode_weight_bytes()
    assert set(step["peaks_gops"]) >= {f"{g['op']}:{g['fmt']}" for g in step["matmuls"]}
    one, four = step["steps"]
    assert (one["rows"], four["rows"]) == (1, 4)
    for row in step["steps"]:
        assert row["decode_steps"] == 5  # 6 tokens: the first comes from the prefill step
        top = sum(v for k, v in row["pieces_ms"].items() if top_level(k))
        assert 0 < top <= row["step_ms"] and row["other_ms"] == pytest.approx(row["step_ms"] - top)
        assert row["pieces_ms"]["  native layers"] <= row["pieces_ms"]["model forward"]
        assert row["ratio"] == pytest.approx(row["step_ms"] / row["bound_ms"])
        assert row["ipc_ms"] is not None and row["ipc_ms"] > 0 and row["matmuls_alone_ms"] > 0
    assert four["compute_ms"] == pytest.approx(4 * one["compute_ms"]) and four["bytes_ms"] == one["bytes_ms"]
    assert len(step_tables(step)[1]["rows"]) == 2
    # the wrappers are gone and the engine computes what it did before
    assert "forward" not in vars(model) and "compute_logits" not in vars(model)
    assert type(engine.runner.sampler).__name__ == "Sampler"  # the object itself again, not a wrapper function
    assert engine.generate([prompt], params)[0].token_ids == before


def test_decode_profile_keeps_the_fastest_round(engine, monkeypatch):
    """Each row is the round with the lowest mean step, with that round's own pieces, and every
    round's mean is kept: rounds scripted out of order, so picking the first or the last fails."""
    import bench.step_timing as st

    means = iter([9.0, 3.0, 1.0, 2.0])  # the warm-up round, then three timed rounds

    def scripted(engine, streams, prompt_len, tokens, tag, seconds):
        ms = next(means)
        return {"rows": streams, "decode_steps": 5, "step_ms": ms, "pieces_ms": {"model forward": ms / 2}}

    monkeypatch.setattr(st, "decode_round", scripted)
    (row,) = st.decode_profile(engine, [2], prompt_len=12, tokens=6, rounds=3)
    assert row["step_ms_rounds"] == [3.0, 1.0, 2.0]
    assert (row["step_ms"], row["pieces_ms"]["model forward"], row["other_ms"]) == (1.0, 0.5, 0.5)
