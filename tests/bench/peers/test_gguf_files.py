"""What a GGUF file holds (``bench.peers.gguf_files``): the bytes one decode token reads, the
tensor-type mix and its label, on GGUFs written with gguf's own writer and on the shipped file.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.peers.gguf_files import decode_bytes, format_label, gguf_weights, type_mix


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
