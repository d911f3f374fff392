"""The context length a served model gets: a profile's ``max_model_len`` is an upper bound (the
CPU profile's 8192 serves a 256-token GGUF at 256), an explicit ``--max-model-len`` is exact (an
error above the model's context, the value itself below it)."""
from __future__ import annotations

import argparse

import pytest

from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
from engine.llm_engine import LLMEngine
from kvserve.cli import add_engine_args, build_engine_config


def engine_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config, _ = build_engine_config(parser.parse_args(["--num-threads", "1", *flags]))
    return config


@pytest.fixture(scope="module")
def short_gguf(tmp_path_factory):
    shape = GGUFShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)
    return str(write_gguf(tmp_path_factory.mktemp("ctx") / "ctx-256.gguf", shape, q4_k_m))


def test_the_profile_context_is_a_cap_and_the_flag_is_exact(short_gguf):
    profiled = engine_config("--model", short_gguf)
    assert profiled.model.max_model_len == 8192 and profiled.model.max_model_len_is_cap  # configs/cpu.yaml
    assert LLMEngine(profiled).max_model_len == 256

    flagged = engine_config("--model", short_gguf, "--max-model-len", "128")
    assert not flagged.model.max_model_len_is_cap
    assert LLMEngine(flagged).max_model_len == 128

    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the model's context of 256 tokens"):
        LLMEngine(engine_config("--model", short_gguf, "--max-model-len", "8192"))
