"""The periodic stats line: every interval while busy, silent while idle, and on demand."""
from __future__ import annotations

import logging
import re
import time

import httpx
import pytest

from tests.metrics.conftest import LOG_STATS_INTERVAL_S

pytestmark = pytest.mark.slow

LINE = re.compile(r"prompt throughput: (?P<prompt>[\d.]+) tokens/s, generation throughput: (?P<gen>[\d.]+) tokens/s, "
                  r"running: (?P<running>\d+), waiting: (?P<waiting>\d+), KV cache usage: (?P<kv>[\d.]+)%, "
                  r"prefix cache hit rate: (?P<hit>[\d.]+)%$")
PREFIX = "A long shared preamble about caching key value tensors for transformer inference. " * 6


def stats_lines(caplog) -> list[re.Match]:
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.stats"]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return matches


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_periodic_line_while_busy_and_quiet_when_idle(live_server, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.stats")
    with httpx.Client(base_url=live_server.url, timeout=120) as c:
        for i in range(2):  # the second prompt hits the cache on PREFIX
            c.post("/v1/completions", json={"model": live_server.model, "prompt": f"{PREFIX} Part {i}.",
                                            "max_tokens": 12, "ignore_eos": True}).raise_for_status()
    # The tick after the traffic still reports it (a busy machine may delay that tick).
    assert wait_for(lambda: any(float(m["gen"]) > 0 for m in stats_lines(caplog))
                    and any(float(m["prompt"]) > 0 for m in stats_lines(caplog)), 30), \
        f"no periodic stats line reporting the traffic: {[r.getMessage() for r in caplog.records]}"

    # Idle from here on: once a line says nothing runs or waits, at most the tick that was
    # already due may still report the traffic; after that, silence.
    assert wait_for(lambda: (m := stats_lines(caplog)) and int(m[-1]["running"]) == 0
                    and int(m[-1]["waiting"]) == 0, 30)
    time.sleep(LOG_STATS_INTERVAL_S * 1.5)
    caplog.clear()
    time.sleep(LOG_STATS_INTERVAL_S * 2.5)
    assert stats_lines(caplog) == [], "stats lines while idle"


def test_log_stats_on_demand(live_server, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.stats")
    with httpx.Client(base_url=live_server.url, timeout=120) as c:
        for i in range(2):
            c.post("/v1/completions", json={"model": live_server.model, "prompt": f"{PREFIX} Section {i}.",
                                            "max_tokens": 4, "ignore_eos": True}).raise_for_status()
    # The responses can reach the client before the core's last snapshot reaches the metrics
    # (a busy machine widens that gap); once it has, any line logged from then on says idle.
    state = lambda: live_server.metrics.state  # noqa: E731
    assert wait_for(lambda: state().num_running == 0 and state().num_waiting == 0 and state().kv_usage == 0, 30)
    live_server.metrics.log_stats()
    lines = stats_lines(caplog)
    assert lines, "log_stats() logged nothing after traffic"
    # The periodic task may have reported part of the traffic already; together the lines cover it.
    assert any(float(m["gen"]) > 0 for m in lines)
    assert any(float(m["hit"]) > 0 for m in lines)  # the second prompt reused PREFIX's blocks
    last = lines[-1]
    assert int(last["running"]) == 0 and int(last["waiting"]) == 0 and float(last["kv"]) == 0.0
