"""lm-eval's ``local-completions`` model runs a loglikelihood task end to end against kvserve:
it sends token-id prompts with ``echo`` + ``logprobs`` and reads the prompt's token logprobs.

Offline: a local task file and dataset (tests/assets/lm_eval), the model's own tokenizer folder.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "lm_eval"


def test_lm_eval_local_completions_loglikelihood(live_server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from engine.loader import resolve_model_dir

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("OPENAI_API_KEY", live_server.api_key)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "tiny_mc.jsonl"
    shutil.copy(ASSETS / "tiny_mc.jsonl", data)
    yaml_text = (ASSETS / "kvserve_tiny_mc.yaml.in").read_text()
    (tasks / "kvserve_tiny_mc.yaml").write_text(
        yaml_text.replace("@DATA@", str(data)).replace("@CACHE@", str(tmp_path / "hf-cache")))

    tokenizer_dir, _ = resolve_model_dir(None)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model={live_server.model},base_url={live_server.v1}/completions,tokenizer={tokenizer_dir},"
                    "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1"),
        tasks=["kvserve_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
        batch_size=1)
    acc = results["results"]["kvserve_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["kvserve_tiny_mc"]
    assert len(samples) == 4
    for sample in samples:
        logliks = [resp[0][0] for resp in sample["resps"]]
        assert len(logliks) == 3 and all(math.isfinite(x) and x < 0 for x in logliks), sample["resps"]
    # the easiest question: the right answer is the most likely continuation
    paris = next(s for s in samples if s["doc"]["question"].startswith("What is the capital"))
    assert max(range(3), key=lambda i: paris["resps"][i][0][0]) == 0
