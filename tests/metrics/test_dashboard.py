"""The shipped Grafana dashboard and provisioning: JSON parses, every query names exported series,
every query is valid PromQL (promtool), and against a real Prometheus scraping a real server
every query returns finite data."""
from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.metrics.conftest import free_port
from tests.metrics.promtool import prometheus_binary, promtool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvserve.json"
# Digits too: a bare [a-z_]+ would read kvserve_e2e_... as kvserve_e.
METRIC = re.compile(r"\bkvserve_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Families an operator needs on the dashboard (issue 5): throughput, TTFT/ITL/e2e, queues, KV, prefix cache.
REQUIRED = {"kvserve_prompt_tokens_total", "kvserve_generation_tokens_total",
            "kvserve_time_to_first_token_seconds_bucket", "kvserve_inter_token_latency_seconds_bucket",
            "kvserve_e2e_request_latency_seconds_bucket", "kvserve_num_requests_running",
            "kvserve_num_requests_waiting", "kvserve_kv_cache_usage_perc", "kvserve_kv_cache_used_tokens",
            "kvserve_kv_cache_capacity_tokens", "kvserve_prefix_cache_hits_total",
            "kvserve_prefix_cache_queries_total", "kvserve_num_preemptions_total"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest theirs
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']}", q))
    return found


def concrete(expr: str, window: str = "1m") -> str:
    """Grafana's variables replaced as Grafana would, so Prometheus can run the query."""
    return expr.replace("$__rate_interval", window).replace("$model_name", ".*")


def test_dashboard_parses_and_has_the_panels():
    d = load_dashboard()
    assert d["uid"] == "kvserve" and 36 <= d["schemaVersion"] <= 41
    panels = [p for p in all_panels(d) if p["type"] != "row"]
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    named = {m for _, q in queries(d) for m in METRIC.findall(q)}
    assert REQUIRED <= named, REQUIRED - named
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        found = {float(x) for _, q in queries(d)
                 for x in re.findall(rf"histogram_quantile\((0\.\d+), .*\bkvserve_{h}_bucket\b", q)}
        assert found == {0.5, 0.9, 0.99}, h


def test_datasource_provisioning_matches_the_dashboard():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    uids = {p["datasource"]["uid"] for p in all_panels(load_dashboard()) if "datasource" in p}
    uids |= {t["datasource"]["uid"] for p in all_panels(load_dashboard()) for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    boards = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvserve.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "kvserve")  # the others: profile scale
    assert job["static_configs"][0]["targets"] == ["kvserve:8000"] and job.get("metrics_path", "/metrics") == "/metrics"


@pytest.mark.slow
def test_every_query_names_only_exported_series(live_server):
    exported = live_server.scrape().sample_names
    families = {n[: -len(s)] for n in exported for s in HISTOGRAM_SUFFIXES if n.endswith(s)}
    for where, q in queries(load_dashboard()):
        names = METRIC.findall(q)
        assert names, f"{where}: no kvserve metric in {q!r}"
        for name in names:
            # A histogram is queried through its series; a bare family name would match nothing.
            assert name in exported, f"{where}: {name} is not exported" + (
                " (a histogram: use _bucket/_sum/_count)" if name in families else "")


def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each expression as a recording rule."""
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(q)}
             for i, (_, q) in enumerate(queries(load_dashboard())) if not q.startswith("label_values(")]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_queries_return_data_from_a_real_prometheus(live_server, tmp_path):
    """The shipped scrape config, pointed at the test server, fed to a real Prometheus; then every
    dashboard query must return at least one finite sample."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [live_server.url.removeprefix("http://")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    proc = subprocess.Popen([prometheus_binary("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def scrapes() -> float:
            """Samples of the target's `up` series so far (a counter of completed scrapes)."""
            r = httpx.get(f"{api}/query", params={"query": 'count_over_time(up{job="kvserve"}[5m])'}, timeout=5)
            result = r.json()["data"]["result"] if r.status_code == 200 else []
            return float(result[0]["value"][1]) if result else 0.0

        def wait_scrapes(n: float, deadline: float) -> None:
            while scrapes() < n:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "Prometheus did not scrape the server"
                time.sleep(0.2)

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        wait_scrapes(1, deadline)  # a baseline before the traffic, so rate() sees the increase
        base = scrapes()
        prefix = "Prometheus scrapes kvserve while this shared prompt prefix is reused. " * 8
        with httpx.Client(base_url=live_server.url, timeout=120) as c:
            for i in range(2):
                c.post("/v1/completions", json={"model": live_server.model, "prompt": f"{prefix}{i}",
                                                "max_tokens": 6, "ignore_eos": True}).raise_for_status()
        wait_scrapes(base + 2, deadline)  # at least one scrape after the traffic
        up = httpx.get(f"{api}/query", params={"query": 'up{job="kvserve"}'}, timeout=5).json()["data"]["result"]
        assert up and up[0]["value"][1] == "1"

        empty = []
        for where, q in queries(load_dashboard()):
            if q.startswith("label_values("):
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", q).groups()
                r = httpx.get(f"{api}/label/{label}/values", params={"match[]": metric}, timeout=10).json()
                assert r["data"] == [live_server.model], where
                continue
            r = httpx.get(f"{api}/query", params={"query": concrete(q, "1m")}, timeout=10).json()
            assert r["status"] == "success", (where, r)
            values = [float(s["value"][1]) for s in r["data"]["result"]]
            if not values or not all(math.isfinite(v) for v in values):
                empty.append((where, q, values))
        assert not empty, empty
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
