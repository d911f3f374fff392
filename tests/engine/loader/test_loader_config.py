"""engine/loader/checkpoint.py reads a GGUF's config and tokenizer without transformers' config classes
(``read_config``, ``load_tokenizer``), and what it reads equals what transformers' Auto classes
read from the same folder: the architecture, the RoPE tables, the tokenizer's ids and chat text."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
from engine.model.arch import ModelArch
from engine.loader.gguf.tensors import gguf_config_dir
from engine.loader import default_gguf_path, load_model
from engine.loader.checkpoint import read_config
from engine.model.rope import rope_cos_sin

REPO = Path(__file__).resolve().parents[3]
TEXTS = ["Hello, world!", "  leading spaces and ünïcödé\n\ttabs", "<|im_start|>user\nhi<|im_end|>", ""]


def gguf_files(tmp_path: Path) -> list[Path]:
    tiny = dict(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, vocab=512, context=256)
    return [default_gguf_path()] + [write_gguf(tmp_path / f"{arch}.gguf", GGUFShape(**tiny, arch=arch), q4_k_m)
                                    for arch in ("llama", "qwen2")]


def test_a_gguf_config_and_tokenizer_equal_transformers_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    for gguf in gguf_files(tmp_path):
        loaded = load_model(str(gguf), blocks_only=True)
        assert isinstance(loaded.hf_config, SimpleNamespace), gguf.name
        reference = AutoConfig.from_pretrained(loaded.path, local_files_only=True)
        assert loaded.arch == ModelArch.from_hf_config(reference), gguf.name
        for ours, theirs in zip(rope_cos_sin(loaded.hf_config, loaded.arch.head_dim, 64),
                                rope_cos_sin(reference, loaded.arch.head_dim, 64)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        tokenizer = AutoTokenizer.from_pretrained(loaded.path, local_files_only=True)
        assert type(loaded.tokenizer) is type(tokenizer)
        assert loaded.tokenizer.all_special_ids == tokenizer.all_special_ids
        assert loaded.tokenizer.eos_token_id == tokenizer.eos_token_id
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert loaded.tokenizer.encode(text) == ids, (gguf.name, text)
            assert loaded.tokenizer.decode(ids) == tokenizer.decode(ids)
        if tokenizer.chat_template:
            chat = [{"role": "user", "content": "What is 2 + 2?"}]
            assert (loaded.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                    == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_loading_a_gguf_imports_no_transformers_config_class():
    """The classes pull in accelerate, torch.distributed.tensor and sympy: ~70 MB per engine."""
    gguf_config_dir(default_gguf_path())  # made once, by transformers, in this process
    code = ("import json, sys\n"
            "from engine.loader import load_model\n"
            "loaded = load_model(None, blocks_only=True)\n"
            "print(json.dumps([m for m in ('accelerate', 'sympy', 'transformers.configuration_utils',"
            " 'transformers.models.llama.configuration_llama') if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_hub_configs_and_scaled_rope_go_through_transformers(tmp_path):
    """A config.json kvserve did not write may omit defaults, and transformers' scaled-RoPE
    initialisers take a config object: both are read by AutoConfig."""
    from transformers import PretrainedConfig

    values = json.loads((gguf_config_dir(default_gguf_path()) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert isinstance(read_config(tmp_path, written_by_kvserve=True), SimpleNamespace)
    assert isinstance(read_config(tmp_path, written_by_kvserve=False), PretrainedConfig)
    values["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(values))
    config = read_config(tmp_path, written_by_kvserve=True)
    assert isinstance(config, PretrainedConfig)
    cos, _ = rope_cos_sin(config, 64, 4096)
    assert cos.shape == (4096, 64)
