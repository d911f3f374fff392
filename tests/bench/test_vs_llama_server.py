"""The ``llama-server`` scenario: without the sid tree (every target skipped with the build
command), the weights each row names, the alternating rounds, and one end-to-end run against
llama.cpp's own server when its sid tree has been built (it skips, naming the build command,
where the tree is missing, and never builds it).
"""
from __future__ import annotations

import os

import pytest

from bench.peers.gguf_files import gguf_weights
from bench.peers.llama_server import rootfs_dir, rootfs_ready


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
    from bench.server import Server
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


# ---- --gguf: one file on both sides ---------------------------------------------------------------
def test_same_file_q4_1_is_the_shipped_file_and_kvserve_needs_no_model_flag():
    from bench.vs_llama_server import same_file_args
    from engine.loader import default_gguf_path

    llama_gguf, serve_args, agreement = same_file_args("Q4_1", ["--max-num-seqs=8"])
    assert llama_gguf == str(default_gguf_path()) and serve_args == ["--max-num-seqs=8"] and agreement
    with pytest.raises(ValueError, match="Q4_K_M"):
        same_file_args("Q5_K_S", None)


@needs_tree
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q8_0"])
def test_same_file_requantized_smollm2_is_served_by_both_sides(qtype):
    """llama-quantize's file (made once, cached): its header says the type asked for, both
    servers get it, and kvserve has a block format (a kernel) for every tensor type in it."""
    from bench.vs_llama_server import same_file_args
    from engine.loader.gguf.blocks import BlockFormat

    llama_gguf, serve_args, agreement = same_file_args(qtype, None)
    weights = gguf_weights(llama_gguf)
    assert weights["file_type"] == qtype and serve_args == [f"--model={llama_gguf}"] and agreement
    mix = {kind for kind, _ in weights["type_mix"] if kind != "F32"}
    # SmolLM2's 576-wide rows are no multiple of 256: a Q4_K_M file is mostly Q5_0 / Q8_0 fallbacks
    assert mix == ({"Q8_0"} if qtype == "Q8_0" else {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})
    assert {BlockFormat[kind].name for kind in mix} == mix  # KeyError for a type kvserve has no kernel for
