"""The llama-server peer and the honest-row helpers: pure logic on a clean machine, and one
end-to-end run against llama.cpp's own server when its sid tree has been built.

The tree is never built here (that is ``sudo scripts/llama-server-peer.sh build``, ~3 min,
network); the end-to-end test skips with that command when it is missing.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bench.agreement import llama_server_token_id, per_prefix_top1, prefixes, top1_agreement
from bench.kv_memory import median_running_while_queued
from bench.llama_server import (MODEL_ALIAS, SCRIPT, LlamaServerConfig, ctx_size_for, decode_bytes, format_label,
                                gguf_weights, kquant_path, quantize_command, rootfs_dir, rootfs_ready,
                                serve_command, type_mix)
from bench.llamacpp import PeerUnavailable


# ---- command building ---------------------------------------------------------------------------
def test_serve_command_passes_threads_slots_and_context(tmp_path):
    cfg = LlamaServerConfig(tmp_path / "m.gguf", port=8123, threads=2, parallel=8, ctx_size=8192,
                            extra=("--cont-batching",))
    cmd = serve_command(cfg)
    assert cmd[:3] == ["bash", str(SCRIPT), "serve"]
    opts = dict(zip(cmd[3:13:2], cmd[4:13:2]))
    assert opts == {"--model": str(tmp_path / "m.gguf"), "--port": "8123", "--threads": "2", "--parallel": "8",
                    "--ctx-size": "8192"}
    # after "--": passed through to llama-server itself
    assert cmd[cmd.index("--") + 1:] == ["--alias", MODEL_ALIAS, "--cont-batching"]


def test_config_rejects_nonsense_and_ctx_size_covers_every_slot(tmp_path):
    with pytest.raises(ValueError):
        LlamaServerConfig(tmp_path / "m.gguf", 1, threads=0)
    with pytest.raises(ValueError):
        LlamaServerConfig(tmp_path / "m.gguf", 1, threads=1, parallel=4, ctx_size=2)
    # 16 slots of (50 prompt + 128 output + 16) tokens: each slot gets ctx_size / parallel >= 194
    total = ctx_size_for(16, 50 + 128 + 16)
    assert total % 16 == 0 and total // 16 >= 194 and total // 16 == 256
    assert ctx_size_for(1, 1000 + 128 + 16) == 1280


def test_quantize_command_and_cache_key(tmp_path):
    src = tmp_path / "SmolLM2-135M-Instruct-F32-abc.gguf"
    src.write_bytes(b"weights")
    dst = kquant_path(src, "Q4_K_M", tmp_path)
    assert dst.parent == tmp_path and dst.name.startswith("SmolLM2-135M-Instruct-abc-Q4_K_M-")
    src.write_bytes(b"other weights")  # another source: another file, never a stale one
    assert kquant_path(src, "Q4_K_M", tmp_path) != dst
    cmd = quantize_command(src, dst, "Q8_0", threads=3)
    assert cmd == ["bash", str(SCRIPT), "quantize", str(src), str(dst), "Q8_0", "--threads", "3"]


def test_script_is_valid_bash_and_explains_a_missing_tree(tmp_path):
    import subprocess

    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    env = dict(os.environ, LLAMA_PEER_ROOTFS=str(tmp_path / "none"))
    out = subprocess.run(["bash", str(SCRIPT), "version"], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "build" in out.stderr and str(tmp_path / "none") in out.stderr


def test_missing_tree_is_peer_unavailable_with_the_build_command(tmp_path, monkeypatch):
    from bench import llama_server

    monkeypatch.setenv("LLAMA_PEER_ROOTFS", str(tmp_path / "none"))
    assert rootfs_dir() == tmp_path / "none" and not rootfs_ready()
    with pytest.raises(PeerUnavailable, match="llama-server-peer.sh build|needs root"):
        llama_server.check_available()


# ---- bytes per token from a GGUF ---------------------------------------------------------------
def test_decode_bytes_counts_the_embedding_only_when_it_is_the_head():
    tied = {"token_embd.weight": 1000, "blk.0.attn_q.weight": 100, "output_norm.weight": 4}
    assert decode_bytes(tied) == 1104  # token_embd is the LM head: read in full
    untied = {**tied, "output.weight": 500}
    assert decode_bytes(untied) == 604  # the embedding is a one-row lookup


def test_type_mix_and_label():
    mix = type_mix([("Q5_0", 50), ("Q8_0", 30), ("Q6_K", 19), ("F32", 1)])
    assert [k for k, _ in mix] == ["Q5_0", "Q8_0", "Q6_K", "F32"] and abs(sum(s for _, s in mix) - 1) < 1e-9
    assert format_label("Q4_K_M", mix) == "Q4_K_M GGUF (Q5_0 50%, Q8_0 30%, Q6_K 19%)"


def _write_gguf(path: Path, tied: bool) -> dict[str, int]:
    """A tiny llama-shaped GGUF: a Q8_0 embedding, Q4_1 and F32 layers; returns the byte sizes."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    tensors = {"token_embd.weight": (rng.standard_normal((64, 64)), gguf.GGMLQuantizationType.Q8_0),
               "blk.0.attn_q.weight": (rng.standard_normal((64, 64)), gguf.GGMLQuantizationType.Q4_1),
               "blk.0.attn_norm.weight": (np.ones(64), gguf.GGMLQuantizationType.F32)}
    if not tied:
        tensors["output.weight"] = (rng.standard_normal((64, 64)), gguf.GGMLQuantizationType.Q4_1)
    sizes = {}
    for name, (data, qtype) in tensors.items():
        data = data.astype(np.float32)
        raw = data if qtype == gguf.GGMLQuantizationType.F32 else quantize(data, qtype)
        writer.add_tensor(name, raw, raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype)
        sizes[name] = raw.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_weights_reads_sizes_from_the_file(tmp_path, tied):
    path = tmp_path / f"tiny-{tied}.gguf"
    sizes = _write_gguf(path, tied)
    # Q8_0: 34 bytes per 32 weights; Q4_1: 20 bytes per 32 weights; F32: 4 bytes a weight
    assert sizes["token_embd.weight"] == 64 * 64 // 32 * 34 and sizes["blk.0.attn_q.weight"] == 64 * 64 // 32 * 20
    w = gguf_weights(path)
    assert w["file_type"] == "Q4_1"
    expected = sum(sizes.values()) - (0 if tied else sizes["token_embd.weight"])
    assert w["decode_bytes"] == expected
    shares = dict(w["type_mix"])
    assert ("Q8_0" in shares) == tied  # the untied file never reads its Q8_0 embedding in full
    assert w["label"].startswith("Q4_1 GGUF (")


def test_shipped_gguf_reads_about_97_mb_per_token():
    """The shipped SmolLM2 Q4_1 file (LM head tied to a Q8_0 embedding): the 97 MB kvserve's
    own decode_weight_bytes reports in BENCHMARKS.md, from the tensor sizes."""
    from engine.loader import default_gguf_path

    w = gguf_weights(default_gguf_path())
    assert w["file_type"] == "Q4_1"
    assert 90e6 < w["decode_bytes"] < 100e6
    assert [k for k, _ in w["type_mix"]][:2] == ["Q4_1", "Q8_0"]


# ---- teacher-forced agreement -----------------------------------------------------------------
def test_top1_agreement_counts_positions_not_text():
    ref = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    cand = [5, 6, 99, 8, 9, 10, 11, 12, 13, 14]  # one near-tie: one position, not the rest
    a = top1_agreement(ref, cand)
    assert a["positions"] == 10 and a["agree"] == 9 and a["fraction"] == 0.9
    assert a["first_differences"] == [[2, 7, 99]]
    assert top1_agreement(ref, ref)["fraction"] == 1.0
    with pytest.raises(ValueError):
        top1_agreement(ref, cand[:-1])
    with pytest.raises(ValueError):
        top1_agreement([], [])


def test_prefixes_and_per_prefix_top1():
    ids = [10, 11, 12, 13]
    assert prefixes(ids) == [[10], [10, 11], [10, 11, 12]]
    assert prefixes(ids, start=2) == [[10, 11], [10, 11, 12]]
    with pytest.raises(ValueError):
        prefixes(ids, start=4)
    # an oracle that knows the text agrees everywhere
    assert per_prefix_top1(lambda p: ids[len(p)], ids) == ids[1:]


def test_hf_top1_matches_per_prefix_greedy():
    """One forward pass gives the same arg-max as one greedy step per prefix."""
    import torch

    from bench.agreement import hf_top1
    from tests.helpers import tiny_hf_model

    model = tiny_hf_model()
    ids = list(range(3, 15))
    one_pass = hf_top1(model, ids)

    def greedy(prefix):
        with torch.inference_mode():
            return int(model(torch.tensor([prefix])).logits[0, -1].argmax())

    assert one_pass == per_prefix_top1(greedy, ids)


def test_engine_top1_batched_equals_one_prefix_at_a_time_and_transformers():
    """kvserve's engine, all prefixes at once, picks what it picks one prefix at a time, and
    what transformers picks (kvserve matches transformers token for token on the same weights)."""
    from bench.agreement import engine_next_token, engine_top1, hf_top1
    from tests.helpers import tiny_engine, tiny_hf_model

    hf = tiny_hf_model()
    engine = tiny_engine(hf, num_blocks=256)
    ids = [(7 * i + 3) % (hf.config.vocab_size - 3) + 3 for i in range(40)]
    batched = engine_top1(engine, ids)
    assert len(batched) == len(ids) - 1 and not engine.has_unfinished()
    assert batched == per_prefix_top1(engine_next_token(engine), ids)
    assert top1_agreement(hf_top1(hf, ids), batched)["fraction"] >= 0.95


def test_llama_server_token_id_reads_both_answer_shapes():
    assert llama_server_token_id({"tokens": [260], "content": " the"}) == 260
    assert llama_server_token_id({"completion_probabilities": [{"id": 17, "token": "x"}]}) == 17
    with pytest.raises(ValueError):
        llama_server_token_id({"content": "x"})


# ---- kv-memory: the verdict rests on the median while queued ----------------------------------
def test_median_running_while_queued_ignores_a_lucky_peak():
    samples = ([{"running": 8, "waiting": 5}] * 5 + [{"running": 20, "waiting": 1}]  # one lucky step
               + [{"running": 3, "waiting": 0}] * 10)  # the tail drains: nobody queued, not counted
    assert median_running_while_queued(samples) == 8
    assert median_running_while_queued([{"running": 4, "waiting": 0}]) is None


# ---- end to end, when the sid tree exists ------------------------------------------------------
needs_tree = pytest.mark.skipif(
    not rootfs_ready() or os.geteuid() != 0,
    reason=f"llama-server's sid tree is not built at {rootfs_dir()} (or not root): build it once with "
           "`sudo scripts/llama-server-peer.sh build` (debootstrap + Debian's llama.cpp-tools, ~3 min)")


@needs_tree
def test_llama_server_scenario_end_to_end(tmp_path):
    """The scenario against a real llama-server on a tiny F32 GGUF of a tiny random Llama, and
    kvserve's in-process server on the same weights: same requests, same token counts."""
    import torch
    from transformers import AutoTokenizer

    from bench.vs_llama_server import run_vs_llama_server
    from engine.loader import resolve_model_dir
    from tests.bench.test_bench_scenarios import _write_tiny_gguf
    from tests.helpers import serve_inprocess, tiny_engine, tiny_hf_model, tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    hf = tiny_hf_model(tiny_llama_config(vocab_size=len(tokenizer), max_position_embeddings=512,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    gguf_path = tmp_path / "tiny-f32.gguf"
    _write_tiny_gguf(hf, gguf_path)

    def engine():
        return tiny_engine(hf, block_size=16, num_blocks=256, max_num_batched_tokens=256, max_num_seqs=16,
                           tokenizer=tokenizer)

    server = serve_inprocess(engine())
    try:
        torch.set_num_threads(1)
        result = run_vs_llama_server(server, engine(), hf, tokenizer, len(tokenizer), threads=1, contexts=(20, 60),
                                     levels=(2, 3), output_len=6, stream_prompt_len=12, single_requests=1, waves=1,
                                     gguf=str(gguf_path), progress=False, out_dir=tmp_path, rounds=2)
    finally:
        server.close()
    assert result["llama_server"]["skipped"] is None, result["llama_server"]
    for pair in [*result["single"].values(), *result["streams"].values()]:
        assert pair["same_output_tokens"], pair
        assert pair["llama-server"]["errors"] == 0 and pair["llama-server"]["output_tps"] > 0
    assert result["streams"][3]["llama-server"]["output_tokens"] == 3 * 6
    assert all(len(pair["round_ratios"]) == 2 for pair in [*result["single"].values(), *result["streams"].values()])
    assert all(r > 0 for r in result["ratios"].values())
    assert result["weights"]["llama-server"]["decode_bytes"] == gguf_weights(gguf_path)["decode_bytes"]
    pairs = result["agreement"]["pairs"]
    # F32 weights on both sides: the arg-max agrees almost everywhere even on random weights
    assert pairs["llama-server vs transformers"]["fraction"] >= 0.9, pairs
    assert pairs["kvserve vs transformers"]["fraction"] >= 0.9, pairs
    assert (tmp_path / "llama-server.png").exists()


def test_scenario_without_the_tree_skips_every_target_with_the_build_command(tmp_path, monkeypatch):
    """On a clean machine the scenario measures nothing (no kvserve-only minutes) and every
    target says why it was skipped and how to fix it."""
    from bench.report import write_scenario
    from bench.serving import Server
    from bench.vs_llama_server import run_vs_llama_server

    monkeypatch.setenv("LLAMA_PEER_ROOTFS", str(tmp_path / "none"))
    never = Server("http://127.0.0.1:9", "m", "url")  # never contacted
    result = run_vs_llama_server(never, None, None, None, 100, threads=1, contexts=(50, 1000), levels=(4, 8, 16),
                                 agreement=False, out_dir=tmp_path)
    assert "build" in result["llama_server"]["skipped"] or "root" in result["llama_server"]["skipped"]
    verdicts = {c["name"]: c["verdict"] for c in result["checks"]}
    assert sum(v == "SKIPPED" for v in verdicts.values()) == 5, verdicts
    assert not result["single"] and not result["streams"]
    assert write_scenario(result, tmp_path).exists()


def test_a_served_gguf_names_kvserves_weights_and_drops_the_default_models_agreement(tmp_path):
    """With ``--serve-arg=--model=PATH`` kvserve's row names that file's format and bytes, not the
    shipped default's, and the in-process (default-model) engine no longer stands for the server."""
    import gguf
    import numpy as np

    from bench.__main__ import served_model
    from bench.vs_llama_server import _weights

    assert served_model(["--model=/a.gguf", "--max-model-len=4096"]) == "/a.gguf"
    assert served_model(["--activation-quant", "int8", "--model", "/b.gguf"]) == "/b.gguf"
    assert served_model(["--num-threads=2"]) is None
    path = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),
                               gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    served = _weights(None, None, None, str(path))["kvserve"]
    default = _weights(None, None, None)["kvserve"]
    assert served["label"].endswith("GGUF blocks (Q8_0 100%)") and "default" not in served["label"]
    assert served["decode_bytes"] == raw.nbytes != default["decode_bytes"]


def test_rounds_alternate_the_servers_on_fresh_prompts_and_take_the_median(monkeypatch):
    """``rounds``: each round gets its own prompts, the first server alternates, each side's row is
    its median run and the ratio the median of the rounds' ratios (adjacent runs)."""
    import bench.vs_llama_server as vs

    calls = []
    figures = {("kvserve", 0): 300.0, ("llama-server", 0): 100.0, ("kvserve", 1): 200.0,
               ("llama-server", 1): 50.0, ("kvserve", 2): 280.0, ("llama-server", 2): 100.0}

    def fake_measure(server, requests, concurrency, label, progress):
        side, r = server, requests[0]
        calls.append((side, r))
        return {"output_tps": figures[(side, r)], "output_tokens": 8, "run": r}

    monkeypatch.setattr(vs, "_measure", fake_measure)
    pair = vs._pair("kvserve", "llama-server", lambda r: [r], 4, "x", False, "output_tps", rounds=3)
    assert calls == [("kvserve", 0), ("llama-server", 0), ("llama-server", 1), ("kvserve", 1),
                     ("kvserve", 2), ("llama-server", 2)]
    assert pair["round_ratios"] == [3.0, 4.0, 2.8]
    assert vs._pair_ratio(pair, "output_tps") == 3.0  # not 280 / 100, the ratio of the median runs
    assert pair["kvserve"]["run"] == 2 and pair["llama-server"]["run"] in (0, 2)
    alone = vs._pair("kvserve", None, lambda r: [r], 4, "x", False, "output_tps", rounds=1)
    assert "round_ratios" not in alone and vs._pair_ratio(alone, "output_tps") is None
