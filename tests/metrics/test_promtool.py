"""The exposition passes Prometheus' own linter, and the shipped scrape config its own checker."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from tests.metrics.promtool import promtool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.slow
def test_promtool_check_metrics_on_a_real_scrape(live_server):
    # Traffic first, so every family has samples (histogram buckets, labelled counters).
    r = httpx.post(f"{live_server.url}/v1/completions", timeout=120,
                   json={"model": live_server.model, "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})
    r.raise_for_status()
    text = live_server.scrape_text()
    for family in ("kvserve_time_to_first_token_seconds_bucket", "kvserve_request_success_total",
                   "kvserve_kv_cache_usage_perc", "kvserve_cache_config_info"):
        assert family in text
    done = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr  # no lint findings


def test_promtool_flags_a_bad_name():
    """The check above is not vacuous: promtool does report what it dislikes."""
    bad = "# HELP kvserve_requests Requests.\n# TYPE kvserve_requests counter\nkvserve_requests 1\n"
    done = subprocess.run([promtool(), "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "_total" in done.stdout + done.stderr


def test_promtool_check_config():
    done = subprocess.run([promtool(), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
