"""Smoke of every ``python -m bench`` scenario on a tiny random Llama (no timing asserts).

The tiny model has the default model's vocabulary, so the real tokenizer (chat template
included) works with it: an in-process server around a tiny engine serves the HTTP scenarios,
and llama.cpp (node-llama-cpp, installed on first use into ~/.cache/kvserve-bench) runs the
same tiny weights from a GGUF written here. Each test checks that the files exist and hold
sane values: positive throughputs, p50 <= p99, utilization in [0, 1].
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.report import write_scenario
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

VERDICTS = {"PASS", "FAIL", "SKIPPED", "INFO"}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)


@pytest.fixture(scope="module")
def hf(tokenizer):
    config = tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=256,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
    return tiny_hf_model(config)


def _engine(hf, tokenizer, num_blocks=256):
    return tiny_engine(hf, block_size=16, num_blocks=num_blocks, max_num_batched_tokens=256, max_num_seqs=64,
                       tokenizer=tokenizer)


@pytest.fixture(scope="module")
def server(hf, tokenizer):
    from bench.server import start_inprocess

    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from server.config import ServerConfig

    service = build_service(EngineConfig(), ServerConfig(log_stats_interval_s=0), engine=_engine(hf, tokenizer))
    srv = start_inprocess(service.app, service.engine.model_name)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def engine(hf, tokenizer):
    """A second engine on the same weights for the in-process scenarios (the server's engine
    belongs to its loop thread)."""
    return _engine(hf, tokenizer)


def _written(result, out: Path) -> dict:
    path = write_scenario(result, out)
    assert path.exists() and (out / f"{result['scenario']}.md").exists()
    data = json.loads(path.read_text())
    for plot in data.get("plots", []):
        assert Path(plot).exists() and Path(plot).stat().st_size > 1000
    assert all(c["verdict"] in VERDICTS for c in data["checks"])
    md = (out / f"{result['scenario']}.md").read_text()
    assert "|" in md and data["title"] in md
    return data


def _ordered(row: dict, key: str) -> None:
    p50, p90, p99 = row[f"{key}_p50_ms"], row[f"{key}_p90_ms"], row[f"{key}_p99_ms"]
    assert 0 < p50 <= p90 <= p99


def test_serve_load(server, tokenizer, tmp_path):
    from bench.serve_load import run_serve_load

    result = run_serve_load(server, len(tokenizer), levels=(1, 3), prompt_len=40, output_len=4, shared_prefix=32,
                            requests_for=lambda c: c + 1, progress=True, out_dir=tmp_path)
    data = _written(result, tmp_path)
    assert (tmp_path / "serve-load.png").exists()
    for row in data["levels"]:
        assert row["errors"] == 0 and row["requests"] == row["concurrency"] + 1
        assert row["output_tokens"] == 4 * row["requests"]
        assert row["output_tps"] > 0 and row["req_per_s"] > 0
        _ordered(row, "ttft")
        _ordered(row, "tpot")
        assert 0.0 <= row["prefix_hit_rate"] <= 1.0
    # the shared 32-token prefix (2 blocks) hits after the first request of a level
    assert data["levels"][-1]["prefix_cache_hits"] > 0


def test_prefix(server, tokenizer, tmp_path):
    from bench.prefix import TARGET, run_prefix, system_prompt

    assert abs(len(tokenizer.encode(system_prompt(tokenizer, 100), add_special_tokens=False)) - 100) <= 3
    data = _written(run_prefix(server, tokenizer, system_tokens=96, rounds=2, progress=False), tmp_path)
    assert not data["errors"]
    assert all(t > 0 for t in data["miss"]["ttft_ms"] + data["hit"]["ttft_ms"])
    assert all(c == 0 for c in data["miss"]["cached_tokens"])  # a fresh salt shares nothing
    assert all(c >= 96 for c in data["hit"]["cached_tokens"])  # the system prompt's blocks hit
    assert data["ttft_ratio"] > 0
    # the target line judges the measured ratio against the 10x target, whichever way it falls
    target = data["checks"][0]
    assert target["value"] == pytest.approx(data["ttft_ratio"], abs=1e-3) and target["target"] == TARGET
    assert target["verdict"] == ("PASS" if data["ttft_ratio"] >= TARGET else "FAIL")
    assert 0 < data["prefix_hit_rate"] <= 1


def test_structured(server, tokenizer, tmp_path):
    from bench.structured import run_structured

    data = _written(run_structured(server, tokenizer, len(tokenizer), concurrency=3, output_len=4, rounds=1,
                                   inject=2, progress=False, gap_rounds=2), tmp_path)
    assert not data["errors"]
    for side in ("unconstrained", "constrained"):
        assert data["sides"][side][0]["output_tokens"] == 3 * 4 and data["sides"][side][0]["output_tps"] > 0
    assert data["tps_ratio"] > 0 and data["gap_ratio"] > 0
    # two alternated stall rounds: two injected requests each; the target's ratio is their median
    assert len(data["injected_first_token_ms"]["fresh"]) == 4 and len(data["gap_round_ratios"]) == 2
    assert data["gap_ratio"] == pytest.approx(sum(data["gap_round_ratios"]) / 2, abs=1e-3)
    assert [c["verdict"] for c in data["checks"][:2]] != ["SKIPPED", "SKIPPED"]


def _write_tiny_gguf(hf, path: Path) -> None:
    """The tiny HF Llama as an F32 GGUF, tokenizer metadata copied from the shipped GGUF, with
    llama.cpp's q/k row permutation (what convert_hf_to_gguf.py does)."""
    import gguf

    from engine.loader import default_gguf_path

    cfg = hf.config
    template = gguf.GGUFReader(default_gguf_path())
    writer = gguf.GGUFWriter(path, arch="llama")
    for field in template.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            writer.add_key_value(field.name, field.contents(), vtype,
                                 sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
            f"blk.{i}.attn_k.weight": permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        }
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    _write_tiny_gguf(hf, path)
    return path


def test_convert_to_f32_dequantizes(hf, tmp_path):
    """convert_to_f32 copies every metadata pair and turns quantized tensors into F32 ones."""
    import gguf
    from gguf.quants import quantize

    from bench.peers.gguf_files import convert_to_f32

    q8 = tmp_path / "tiny-q8.gguf"
    writer = gguf.GGUFWriter(q8, arch="llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_key_value("tokenizer.ggml.tokens", ["<s>", "a", "b"], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.STRING)
    writer.add_rope_freq_base(10000.0)
    q = hf.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    norm = hf.model.norm.weight.detach().numpy()
    writer.add_tensor("blk.0.attn_q.weight", quantize(q, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = tmp_path / "back-f32.gguf"
    convert_to_f32(q8, out)
    back = gguf.GGUFReader(out)
    assert {t.tensor_type for t in back.tensors} == {gguf.GGMLQuantizationType.F32}
    assert back.get_field("general.file_type").contents() == int(gguf.LlamaFileType.ALL_F32)
    assert back.get_field("general.name").contents() == "tiny"
    assert back.get_field("tokenizer.ggml.tokens").contents() == ["<s>", "a", "b"]
    assert back.get_field("llama.rope.freq_base").contents() == 10000.0
    got = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in back.tensors}
    np.testing.assert_allclose(got["blk.0.attn_q.weight"], q, atol=0.01)  # Q8_0 round trip
    np.testing.assert_array_equal(got["output_norm.weight"], norm)


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="node/npm not installed")
def test_peers(server, engine, hf, tokenizer, tiny_gguf, tmp_path):
    from bench.vs_peers import ALL_PEERS, run_peers

    torch.set_num_threads(1)
    result = run_peers(server, hf, tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1, peers=ALL_PEERS,
                       prompt_len=24, output_len=4, single_requests=1, batch_size=3, gguf=tiny_gguf,
                       progress=False, out_dir=tmp_path, engine=engine)
    torch.set_num_threads(1)
    data = _written(result, tmp_path)
    sides = data["sides"]
    assert sides["kvserve"]["single"]["decode_tps"] > 0 and sides["kvserve"]["batch"]["tps"] > 0
    assert sides["kvserve"]["batch"]["output_tokens"] == 3 * 4
    engine_side = sides["kvserve-engine"]
    assert engine_side["single"]["decode_tps"] > 0 and engine_side["batch"]["output_tokens"] == 12
    for peer in ALL_PEERS:  # every peer ran, or says why not: never silently dropped
        for phase in ("single", "batch"):
            side = sides[peer][phase]
            assert "skipped" in side or side.get("decode_tps", side.get("tps")) > 0, (peer, phase, side)
    assert sides["hf"]["batch"]["output_tokens"] == 12
    assert "skipped" not in sides["llamacpp"]["single"], sides["llamacpp"]["single"]
    assert sides["llamacpp"]["batch"]["output_tokens"] == 12
    # teacher-forced agreement: every position of the fixed text compared, F32 weights on both sides
    pairs = data["agreement"]["pairs"]
    assert set(pairs) == {"llama.cpp vs transformers", "llama.cpp vs kvserve"}, data["agreement"]
    assert all(a["positions"] == data["agreement"]["positions"] > 50 for a in pairs.values())
    assert pairs["llama.cpp vs transformers"]["fraction"] >= 0.9, pairs
    weights = data["weights"]  # every row says what it reads
    assert weights["hf"]["label"] == "dense fp32" and weights["llamacpp"]["label"].startswith("F32 GGUF")
    assert weights["hf"]["decode_bytes"] > 0 and weights["llamacpp"]["decode_bytes"] > 0
    names = [c["name"] for c in data["checks"]]
    assert sum("kvserve /" in n for n in names) == 5  # the five peer targets, each PASS/FAIL/SKIPPED
    assert all(r is None or r > 0 for r in data["ratios"].values())


def test_kv_cache(engine, hf, tokenizer, tmp_path):
    from bench.kv_cache import run_kv_cache

    prompt = tokenizer.encode("Tell me about the sea.")
    data = _written(run_kv_cache(engine, hf, prompt, len(tokenizer), new_tokens=3, contexts=(8, 16, 32), repeats=1,
                                 out_dir=tmp_path), tmp_path)
    assert (tmp_path / "kv-cache.png").exists()
    for row in data["per_token"]:
        assert row["hf_nocache_ms"] > 0 and row["hf_cache_ms"] > 0 and row["kvserve_ms"] > 0
    for side in data["generation"].values():
        assert side["ttft_ms"] > 0 and side["tpot_ms"] > 0
    assert set(data["fits"]) == {"hf_nocache", "hf_cache", "kvserve"}
    assert not engine.has_unfinished()


def test_in_process_scenario_runners_hand_the_engine_s_vocabulary_on(engine, hf, monkeypatch, tmp_path):
    """``python -m bench kv-cache`` / ``kv-memory`` as ``bench all`` runs them (``RUNNERS[name](ctx)``),
    with the measurement functions recorded instead of run: the glue between the context's engine
    and them works (it read ``engine.model.arch`` after the engine lost that attribute, and both
    scenarios crashed in ``bench all`` while the tests above, which call the functions, passed)."""
    import argparse
    import types

    import bench.kv_cache
    import bench.kv_memory
    from bench.__main__ import RUNNERS

    calls = {}
    monkeypatch.setattr(bench.kv_cache, "run_kv_cache", lambda *a, **k: calls.setdefault("kv-cache", (a, k)))
    monkeypatch.setattr(bench.kv_memory, "run_kv_memory", lambda *a, **k: calls.setdefault("kv-memory", (a, k)))
    monkeypatch.setattr(bench.kv_memory, "build_engine", lambda *a, **k: engine)
    ctx = types.SimpleNamespace(args=argparse.Namespace(quick=True, seed=0, no_progress=True), engine=engine, hf=hf,
                                out=tmp_path, threads=1)
    RUNNERS["kv-cache"](ctx)
    RUNNERS["kv-memory"](ctx)
    vocab = engine.arch.vocab_size
    args, _ = calls["kv-cache"]
    assert args[0] is engine and args[1] is hf and args[3] == vocab and args[2]
    (_, requests), _ = calls["kv-memory"]
    assert requests and all(max(r.prompt_token_ids) < vocab for r in requests)


def test_kv_memory(hf, tokenizer, tmp_path):
    from bench.kv_memory import run_kv_memory
    from bench.workload import make_requests

    engine = _engine(hf, tokenizer, num_blocks=4 * 256 // 16)  # 4 x max_model_len (256) slots
    requests = make_requests(40, (16, 96), (4, 16), len(tokenizer), seed=3)  # ~3,000 tokens for 1,024 slots
    data = _written(run_kv_memory(engine, requests, progress=False, out_dir=tmp_path), tmp_path)
    assert (tmp_path / "kv-memory.png").exists()
    assert data["workload"]["finished"] == 40 and data["samples"] > 0
    assert 0 < data["utilization_min"] <= data["utilization"] <= 1
    assert data["contiguous_fit"] == 4 and data["peak_running"] >= 1
    # requests queued for blocks, so the verdict rests on the median while queued, peak beside it
    median = data["median_running_while_queued"]
    assert median is not None and 1 <= median <= data["peak_running"]
    assert data["concurrency_ratio"] == round(median / 4, 3)
    check = next(c for c in data["checks"] if c["name"].startswith("concurrent requests"))
    assert "median" in check["name"] and f"peak {data['peak_running']}" in check["detail"]
    assert not engine.has_unfinished()



def test_kv_memory_verdict_rests_on_the_median_while_queued_not_a_lucky_peak():
    from bench.kv_memory import median_running_while_queued

    samples = ([{"running": 8, "waiting": 5}] * 5 + [{"running": 20, "waiting": 1}]  # one lucky step
               + [{"running": 3, "waiting": 0}] * 10)  # the tail drains: nobody queued, not counted
    assert median_running_while_queued(samples) == 8
    assert median_running_while_queued([{"running": 4, "waiting": 0}]) is None


def test_kv_tier(hf, tmp_path):
    from bench.kv_tier import run_kv_tier

    def make(folder):
        return tiny_engine(hf, block_size=16, num_blocks=(200 + 64) // 16, max_num_batched_tokens=256,
                           kv_disk_dir=folder, kv_disk_gib=0.05)

    data = _written(run_kv_tier(make, hf.config.vocab_size, prefix_tokens=200, rounds=1, progress=False), tmp_path)
    # Every hit found its whole prefix (all full blocks but the last token's), mostly from the disk tier.
    assert data["cached_tokens"]["evicted"] == [192] and data["cached_tokens"]["restart"] == [192]
    assert 0 < data["disk_hit_tokens_evicted"] <= 192  # the first blocks may still be on the device
    assert all(t > 0 for t in data["miss_ms"] + data["evicted_hit_ms"] + data["restart_hit_ms"])


def test_roofline(engine, tokenizer, tmp_path):
    from bench.roofline import BANDWIDTH_TARGET, run_roofline

    prompts = [tokenizer.encode(q) for q in ("What is the sea?", "Name a colour.", "Why is the sky blue?")]
    data = _written(run_roofline(engine, prompts[:1], prompts, new_tokens=4, matmul_n=256, bandwidth_mib=16,
                                 repeats=2, out_dir=tmp_path, rows_levels=(1, 2), step_tokens=4, step_prompt_len=8,
                                 kernel_min_s=0.01), tmp_path)
    assert (tmp_path / "roofline.png").exists()
    assert data["machine_bounds"]["matmul_gflops"] > 0 and data["machine_bounds"]["bandwidth_gbs"] > 0
    assert data["kvserve_single_decode_tps"] > 0 and data["kvserve_batch_tps"] > 0
    assert data["bandwidth_fraction"] > 0 and data["compute_fraction"] > 0
    bound = data["checks"][0]
    assert bound["value"] == pytest.approx(data["bandwidth_fraction"], abs=1e-3) and bound["target"] == BANDWIDTH_TARGET
    # the dense tiny model: every matmul is a dense fp32 one, bounded by the fp32 matmul peak
    step = data["step_roofline"]
    assert [g["op"] for g in step["matmuls"]] == ["dense"] and [r["rows"] for r in step["steps"]] == [1, 2]
    assert data["checks"][-1]["name"] == "2-row decode step / its roofline"
    assert data["checks"][-1]["value"] == pytest.approx(step["steps"][-1]["ratio"], abs=1e-3)
    assert bound["verdict"] == ("PASS" if data["bandwidth_fraction"] >= BANDWIDTH_TARGET else "FAIL")


def test_cli_and_benchmarks_md(tmp_path):
    from bench.__main__ import build_parser
    from bench.report import check, summary_markdown, write_benchmarks_md

    parser = build_parser()
    for scenario in ("serve-load", "peers", "llama-server", "kv-cache", "prefix", "kv-memory", "roofline", "structured", "all"):
        assert parser.parse_args([scenario, "--quick"]).scenario == scenario
    # `kvserve bench` execs `python -m bench` (so it cannot run in this process: the exec would
    # replace pytest and end the session with status 0); the bench parser answers, named for it
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvserve bench") and "llama-server" in out.stdout

    plot = tmp_path / "x.png"
    plot.write_bytes(b"\x89PNG fake")
    results = [{"scenario": "prefix", "title": "Prefix", "machine": {}, "tables": [],
                "checks": [check("prefix hit TTFT lower than a miss", 12.0, 10.0),
                           check("p99 gap", 0.9, 1.25, higher_is_better=False),
                           check("llama.cpp", None, 3.0, skipped="node missing")], "plots": [str(plot)]}]
    run = {"command": "python -m bench all", "started": "a", "finished": "b", "wall_s": 60, "quick": True,
           "loadavg_before": [1, 1, 1], "loadavg_after": [1, 1, 1], "foreign_cpu_cores": 0.1,
           "machine": {"cpu": "cpu", "cores": 2, "mem_gib": 1, "python": "3", "torch": "t", "transformers": "5",
                       "threads": 2}}
    assert "PASS" in summary_markdown(results, run) and "SKIPPED: node missing" in summary_markdown(results, run)
    # each target with its own direction (a lower-is-better line once read ">=" in BENCHMARKS.md)
    assert "| prefix hit TTFT lower than a miss (>= 10.0x) |" in summary_markdown(results, run)
    assert "| p99 gap (<= 1.25x) | 0.9x | PASS |" in summary_markdown(results, run)
    md = tmp_path / "BENCH.md"
    write_benchmarks_md(results, run, md, tmp_path / "plots")
    text = md.read_text()
    assert "python -m bench all" in text and "(plots/x.png)" in text and (tmp_path / "plots" / "x.png").exists()


def test_check_and_verdict_judge_a_value_against_its_target():
    """Controlled values on both sides of a target: the verdicts every scenario and probe report."""
    from bench.report import FAIL, PASS, SKIPPED, check, verdict

    assert [check("x", v, 2.0)["verdict"] for v in (2.5, 2.0, 1.99)] == [PASS, PASS, FAIL]
    assert [check("ms", v, 10.0, higher_is_better=False)["verdict"] for v in (9.0, 10.0, 11.0)] == [PASS, PASS, FAIL]
    assert check("x", None, 2.0)["verdict"] == SKIPPED and check("x", float("nan"), 2.0)["verdict"] == SKIPPED
    assert check("x", 3.0, 2.0, skipped="peer missing") == {"name": "x", "value": None, "target": 2.0, "unit": "x",
                                                            "verdict": SKIPPED, "detail": "peer missing"}
    assert [verdict(v, 1.5) for v in (1.6, 1.5, 1.49, None)] == [PASS, PASS, FAIL, FAIL]

