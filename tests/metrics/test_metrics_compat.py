"""``--metrics-compat vllm``: the vLLM names routers read carry the ``kvserve_`` values, under load.

Scrapes are parsed with prometheus_client's own parser, as a router's scraper would.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import generate_latest

from server import metrics_compat
from server.metrics_compat import VLLM_FAMILIES
from tests.metrics.conftest import Scrape

# What the Gateway API Inference Extension's endpoint picker, llm-d and vllm-router read.
ROUTER_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total", "vllm:cache_config_info",
                "vllm:lora_requests_info")
SHARED = "You are a terse assistant for a shipping company. Answer in one word. " * 8


def compat_pairs(scrape: Scrape) -> list[tuple[str, str, frozenset, frozenset]]:
    """(kvserve sample, vllm sample, vllm labels, kvserve labels) for every sample with vLLM copies."""
    pairs = []
    for family in scrape.families.values():
        short = family.name.removeprefix("kvserve_")
        if short == family.name or short not in VLLM_FAMILIES:
            continue
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            labels = frozenset(sample.labels.items())
            vlabels = labels
            if suffix == "_info":
                vlabels = frozenset((metrics_compat.CACHE_CONFIG_LABELS.get(k, k), v) for k, v in labels)
            for alias in VLLM_FAMILIES[short]:
                pairs.append((sample.name, f"vllm:{alias}{suffix}", vlabels, labels))
    return pairs


def assert_equal_families(scrape: Scrape) -> int:
    checked = 0
    for kv_name, vllm_name, vlabels, labels in compat_pairs(scrape):
        assert (vllm_name, vlabels) in scrape.samples, f"{vllm_name}{dict(vlabels)} missing"
        assert scrape.samples[(vllm_name, vlabels)] == scrape.samples[(kv_name, labels)], (kv_name, vllm_name)
        checked += 1
    return checked


@pytest.fixture
def compat_server(live_server):
    """The session's live server with the vLLM names switched on for one test, then off again."""
    metrics = live_server.metrics
    metrics_compat.enable(metrics, "vllm")
    try:
        yield live_server
    finally:
        metrics.exposition = metrics.registry


@pytest.mark.slow
def test_vllm_names_equal_the_kvserve_ones_under_load(compat_server):
    s, model = compat_server, compat_server.model
    first = s.scrape()
    for name in ROUTER_NAMES:
        assert any(n == name for n in first.sample_names), name
    # Types as the readers expect them (the endpoint picker checks gauges; rate() needs counters).
    assert first.families["vllm:num_requests_waiting"].type == "gauge"
    assert first.families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert first.families["vllm:prefix_cache_hits"].type == "counter"
    cap = s.engine.info  # what the core reported at start (block size, pool size)
    info = first.labels_of("vllm:cache_config_info")
    assert info["block_size"] == str(cap.block_size) and info["num_gpu_blocks"] == str(cap.num_blocks)
    lora = first.labels_of("vllm:lora_requests_info")
    assert lora["max_lora"] == "0" and lora["running_lora_adapters"] == ""

    def one(i: int) -> None:
        with s.client() as c:
            r = c.post("/v1/completions", json={"model": model, "prompt": f"{SHARED}Q{i}: ship or hold?",
                                                "max_tokens": 64, "ignore_eos": True, "temperature": 0})
            r.raise_for_status()

    seen: list[Scrape] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        while not all(f.done() for f in futures):
            seen.append(s.scrape())
            time.sleep(0.1)
        for f in futures:
            f.result()
    seen.append(s.scrape())
    checked = [assert_equal_families(x) for x in seen]
    assert min(checked) >= 20, checked  # every mapped family (gauges, counters, histograms) was compared
    assert any(x.get("vllm:num_requests_running") >= 1 for x in seen), "never scraped while a request ran"
    assert any(x.get("vllm:kv_cache_usage_perc") > 0 for x in seen)
    last = seen[-1]
    assert last.get("vllm:prefix_cache_hits_total") > first.get("vllm:prefix_cache_hits_total")
    assert last.get("vllm:prefix_cache_queries_total") >= last.get("vllm:prefix_cache_hits_total")


def test_off_by_default_and_bad_modes_refused(tmp_path):
    from kvserve.cli import main
    from server.config import ServerConfig
    from tests.helpers import tiny_engine, tiny_hf_model
    from server.metrics import Metrics

    engine = tiny_engine(tiny_hf_model())
    metrics = Metrics(engine.info)
    assert "vllm:" not in generate_latest(metrics.exposition).decode()
    with pytest.raises(ValueError, match="metrics_compat"):
        metrics_compat.enable(metrics, "sglang")
    with pytest.raises(ValueError, match="metrics_compat"):
        ServerConfig(metrics_compat="sglang")
    metrics_compat.enable(metrics, "vllm")
    text = generate_latest(metrics.exposition).decode()
    scrape = Scrape.parse(text)
    assert scrape.get("vllm:num_requests_waiting") == scrape.get("kvserve_num_requests_waiting") == 0
    assert scrape.labels_of("vllm:cache_config_info")["num_gpu_blocks"] == "128"
    # The CLI flag and the profile key reach ServerConfig.
    profile = tmp_path / "p.yaml"
    profile.write_text("server:\n  metrics_compat: vllm\n")
    seen = {}
    import kvserve.cli as cli

    orig = cli.cmd_serve
    try:
        cli.cmd_serve = lambda args: seen.setdefault("args", args) and 0
        assert main(["serve", "--metrics-compat", "vllm"]) == 0
    finally:
        cli.cmd_serve = orig
    assert seen["args"].metrics_compat == "vllm"
    from configs import build_section, read_profile

    assert build_section(ServerConfig, "server", read_profile(str(profile)), {}).metrics_compat == "vllm"
