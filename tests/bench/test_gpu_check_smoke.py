"""bench.gpu_check --smoke: every phase of the GPU check runs on a tiny model on the CPU,
so the script the H200 runs cannot rot unnoticed (its numbers here mean nothing)."""
from __future__ import annotations

import json

from bench.gpu_check import LLAMA_31_8B, hf_weight_shapes, main, make_requests


def test_smoke_runs_every_phase(tmp_path):
    result = main(["--smoke", "--num-requests", "3", "--hf-requests", "1", "--batch1-tokens", "3",
                   "--out", str(tmp_path), "--name", "smoke"])
    assert result["errors"] == []
    assert result["offline"]["output_tokens"] == sum(r.output_len for r in make_requests(3, 4, 16, 512))
    assert result["http"]["errors"] == 0 and result["http"]["tpot_p50_ms"] is not None
    assert result["http"]["metrics_scraped"]
    assert result["hf"]["useful_output_tokens"] == result["subset_kvserve"]["output_tokens"]
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert set(saved["verdicts"]) == {"offline_output_tps", "hf_ratio", "http_tpot_p50_ms", "batch1_bound_ratio"}
    assert "SMOKE" in (tmp_path / "smoke.md").read_text()


def test_8b_shape_has_8b_parameters():
    params = sum(int.__mul__(*s) if len(s) == 2 else s[0] for s in hf_weight_shapes(LLAMA_31_8B).values())
    assert 8.0e9 < params < 8.1e9  # Llama-3.1-8B: 8.03 B
