"""bench.probes.kv_compression at tiny sizes on a tiny random Llama: the table's structure, the
pool's own accounting (int4 < int8 < fp16 < fp32 bytes per token), streaming's held tokens bounded
by its sink block + window + a step, more concurrent requests under eviction than dense (verified
by admission), the flatness section's refusal of dense past the context, and the kvpress peer
(skipped with its reason when kvpress is absent: it is an optional bench peer)."""
from __future__ import annotations

import math

import pytest

from bench.probes.kv_compression import BLOCK, admit, build_parser, kvpress_missing, markdown, run
from tests.helpers import tiny_engine, tiny_hf_model

MAX_LEN = 256
BYTES_FP32 = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head_dim x (K, V) x fp32


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model()


def tiny_factory(hf):
    def make(policy, *, max_model_len, max_num_batched_tokens, max_num_seqs, kv_gib=None, num_blocks=None):
        evict = {} if policy.eviction == "none" else dict(
            kv_eviction=policy.eviction, kv_sink_tokens=policy.sinks, kv_window_tokens=policy.window,
            kv_budget_tokens=policy.budget)
        return tiny_engine(hf, block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs, attention_backend=policy.backend,
                           kv_cache_dtype=policy.kv_dtype, kv_cache_memory_gib=kv_gib or 1.0, **evict)
    return make


def tiny_args(**overrides):
    # a pool of 1,200 fp32 tokens (75 blocks): four 256-token dense fp32 requests, more under eviction
    args = build_parser().parse_args([
        "--tokens", "192", "--score-from", "96", "--window", "32", "--chunk", "16", "--max-model-len", str(MAX_LEN),
        "--max-num-seqs", "32", "--pool-gib", str(1200 * BYTES_FP32 / 2**30), "--request-tokens", str(MAX_LEN),
        "--step-tokens", "128", "--streams", "4", "--decode-prompt", "48", "--decode-tokens", "4",
        "--flat-window", "32", "--flat-totals", "64", "128", "512", "--flat-decode", "8", "--flat-pool-gib",
        str(600 * BYTES_FP32 / 2**30)])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def result(hf):
    import random

    rng = random.Random(3)
    ids = [rng.randrange(3, hf.config.vocab_size) for _ in range(192)]
    return run(tiny_args(), tiny_factory(hf), hf_model=hf, ids=ids)


def test_table_rows_and_quality(result):
    table = result["table"]
    assert [r["policy"]["label"] for r in table][:4] == ["dense fp32", "dense fp16", "dense int8", "dense int4 (KIVI)"]
    assert [r["policy"]["eviction"] for r in table] == ["none"] * 4 + ["streaming", "streaming", "h2o"]
    dense = table[0]
    assert dense["nll_delta"] == 0 and dense["top1_vs_dense_fp32"] == 1
    for r in table:
        assert math.isfinite(r["nll"]) and 0 <= r["top1_vs_dense_fp32"] <= 1 and r["decode_tps"] > 0
    assert table[1]["top1_vs_dense_fp32"] > 0.95  # fp16 KV barely moves the logits
    # the sink block carries the text: window-only is worse than sinks + window (random weights: weak, but > 0)
    assert table[5]["nll"] != table[4]["nll"]


def test_bytes_per_token_from_the_pool(result):
    per = {r["policy"]["kv_dtype"]: r["bytes_per_token"] for r in result["table"][:4]}
    assert per["float32"] == BYTES_FP32 and per["float16"] == BYTES_FP32 // 2
    assert per["int4"] < per["int8"] < per["float16"] < per["float32"]
    # dense rows hold the whole text (rounded up to blocks); eviction rows the sink block + window + a chunk
    text = result["text_tokens"]
    for r in result["table"][:4]:
        assert r["peak_tokens_held"] == math.ceil(text / BLOCK) * BLOCK
    sinks, window, chunk = 4, 32, 16
    assert result["table"][4]["peak_tokens_held"] <= math.ceil(sinks / BLOCK) * BLOCK + window + BLOCK + chunk
    assert result["table"][5]["peak_tokens_held"] <= window + BLOCK + chunk
    assert result["table"][6]["peak_tokens_held"] <= result["table"][6]["policy"]["budget"] + chunk
    assert result["table"][4]["held_bytes_per_text_token"] < result["table"][1]["held_bytes_per_text_token"]


def test_concurrency_verified_by_admission(result, hf):
    conc = {r["policy"]["label"]: r["concurrency"] for r in result["table"]}
    fp32 = conc["dense fp32"]
    # 75 blocks hold four 256-token requests (16 blocks each: 255 tokens of KV at the end)
    assert fp32["pool_blocks"] == 1200 // BLOCK and fp32["blocks_per_request"] == MAX_LEN // BLOCK
    assert fp32["verified"] == fp32["derived"] == 4
    assert conc["dense fp16"]["verified"] > fp32["verified"]
    streaming = conc[result["table"][4]["policy"]["label"]]
    assert streaming["verified"] > conc["dense fp16"]["verified"]  # same fp16 pool, bounded held tokens
    for label, c in conc.items():  # one request's peak bounds it below; dense holds it whatever the company
        assert c["verified"] >= c["derived"] >= 1
        if label.startswith("dense"):
            assert c["verified"] == c["derived"] or c["capped"]


def test_admission_preempts_past_the_pool(hf):
    make = tiny_factory(hf)
    from bench.probes.kv_compression import policies

    engine = make(policies(4, 32)[0], max_model_len=MAX_LEN, max_num_batched_tokens=16, max_num_seqs=32,
                  kv_gib=1200 * BYTES_FP32 / 2**30)
    four, five = admit(engine, 4, MAX_LEN, 128), admit(engine, 5, MAX_LEN, 128)
    assert four["peak_running"] == 4 and four["preemptions"] == 0
    assert five["preemptions"] > 0


def test_flatness_refuses_dense_past_the_context(result):
    rows = result["flat"]["rows"]
    assert [r["total_tokens"] for r in rows] == [64, 128, 512]
    assert all(r["streaming_tps"] > 0 for r in rows)
    assert isinstance(rows[0]["dense_tps"], float) and rows[0]["dense_tps"] > 0
    assert isinstance(rows[2]["dense_tps"], str) and "context length" in rows[2]["dense_tps"]


def test_kvpress_peer_or_its_reason(result):
    peer = result["peer"]
    reason = kvpress_missing()
    if reason is not None:
        assert peer == {"skipped": reason}
        pytest.skip(reason)
    sinks_row, window_row, shipped = peer["rows"]
    # the same kept set on the same weights: kvpress (order kept) and kvserve agree token for token
    for row in (sinks_row, window_row):
        assert row["kvserve_nll"] == pytest.approx(row["kvpress_nll"], abs=1e-3)  # kvserve's row: fp16 KV
        assert row["top1_kvserve_vs_kvpress"] == 1.0
    # kvpress as shipped reorders the cache at each compression, so later ones keep other tokens
    assert "as shipped" in shipped["policy"] and abs(shipped["kvpress_nll"] - sinks_row["kvpress_nll"]) > 1e-3
    assert peer["kvpress_decode_tps"] > 0 and peer["kvserve_decode_tps"] > 0


def test_markdown_has_every_section(result):
    text = markdown(result)
    assert sum(line.startswith("| dense ") for line in text.splitlines()) == 4
    assert "Streaming flatness" in text and "kvpress" in text
