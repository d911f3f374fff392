"""engine/loader/gguf/reader.py against gguf's own GGUFReader: the same tensor table and bytes, from
files gguf's writer made (every metadata value type, a custom alignment) and from the shipped
SmolLM2 GGUF that llama.cpp wrote; clear errors for files that are not whole GGUFs."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
from engine.loader.gguf.reader import GGUFFormatError, read_gguf_index

TINY = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)


def assert_same_as_gguf_reader(path) -> None:
    reader = gguf.GGUFReader(str(path))
    index = read_gguf_index(path)
    field = reader.fields["general.architecture"]
    assert index.architecture == bytes(field.parts[field.data[0]]).decode()
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    with open(path, "rb") as raw:
        for ours, theirs in zip(index.tensors, reader.tensors):
            assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
            assert ours.ggml_type == int(theirs.tensor_type), ours.name
            assert (ours.offset, ours.n_bytes) == (int(theirs.data_offset), int(theirs.n_bytes)), ours.name
            data = ours.read(raw)
            assert data.shape == (ours.rows, ours.row_bytes)
            np.testing.assert_array_equal(data.reshape(-1), np.asarray(theirs.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_files_match_gguf_reader(tmp_path, arch):
    """Q4_K, Q6_K and F32 matrices, F32 norms (and qwen2's biases), the tokenizer's string arrays."""
    path = write_gguf(tmp_path / f"{arch}.gguf", GGUFShape(**{**TINY.__dict__, "arch": arch}), q4_k_m)
    assert_same_as_gguf_reader(path)


def test_the_shipped_model_matches_gguf_reader():
    from engine.loader import default_gguf_path

    assert_same_as_gguf_reader(default_gguf_path())


def test_every_value_type_and_a_custom_alignment(tmp_path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_float64("t.f64", 0.5)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", ""])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b.weight", np.arange(64, dtype=np.float16).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = read_gguf_index(path)
    assert [t.offset % 64 for t in index.tensors] == [0, 0]
    assert_same_as_gguf_reader(path)


def test_files_that_are_not_whole_ggufs_are_clear_errors(tmp_path):
    good = write_gguf(tmp_path / "good.gguf", TINY, q4_k_m).read_bytes()
    cases = {
        "not a GGUF file": b"GGML" + good[4:],
        "version 1 is not supported": good[:4] + (1).to_bytes(4, "little") + good[8:],
        "runs past the end of the file": good[:-100],  # the last tensor's data cut short
        "header runs past the end": good[:200],
    }
    for message, content in cases.items():
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf_index(bad)


def test_loading_blocks_parses_no_metadata_values(tmp_path, monkeypatch):
    """The weights load without gguf's GGUFReader, which materializes the tokenizer (engine/loader/gguf/reader.py)."""
    from engine.model.arch import ModelArch
    from engine.loader.gguf.tensors import read_gguf_tensors
    from engine.loader.gguf.tensors import read_gguf_blocks

    path = write_gguf(tmp_path / "tiny.gguf", TINY, q4_k_m)

    def refuse(*args, **kwargs):
        raise AssertionError("GGUFReader was used")

    arch = ModelArch(model_type="llama", vocab_size=TINY.vocab, hidden_size=TINY.hidden, intermediate_size=TINY.ffn,
                     num_layers=TINY.layers, num_heads=TINY.heads, num_kv_heads=TINY.kv_heads,
                     head_dim=TINY.hidden // TINY.heads, rms_norm_eps=1e-5, max_position_embeddings=TINY.context,
                     tie_word_embeddings=False, attention_bias=False, eos_token_ids=frozenset())
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    blocks, dense = read_gguf_tensors(path, arch)
    assert set(read_gguf_blocks(path, arch)) == set(blocks)
    assert "model.layers.0.self_attn.q_proj.weight" in blocks and "model.norm.weight" in dense
