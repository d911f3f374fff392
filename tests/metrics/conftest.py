"""A real kvserve server for the metrics tests: what ``kvserve serve`` builds (the composition root,
engine core in its own process), under uvicorn in a thread on a free port."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The periodic stats line every second, so its test can watch it fire on its own.
LOG_STATS_INTERVAL_S = 1.0


@dataclass
class LiveServer:
    url: str
    model: str
    metrics: object  # server.metrics.Metrics
    engine: object  # the engine client (its .info and .stats)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def scrape_text(self) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        assert r.headers["content-type"].startswith("text/plain")
        return r.text

    def scrape(self) -> "Scrape":
        return Scrape.parse(self.scrape_text())


class Scrape:
    """Samples of one exposition, parsed by prometheus_client's own parser."""

    def __init__(self, families: list) -> None:
        self.families = {f.name: f for f in families}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in families:
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        return cls(list(text_string_to_metric_families(text)))

    @property
    def sample_names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def get(self, name: str, **labels: str) -> float:
        """The one sample ``name`` whose labels include ``labels`` (KeyError if none, or several)."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        if len(found) != 1:
            raise KeyError(f"{len(found)} samples {name}{labels}")
        return found[0]

    def labels_of(self, name: str) -> dict[str, str]:
        found = [dict(ls) for (n, ls) in self.samples if n == name]
        assert len(found) == 1, found
        return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def live_server():
    import uvicorn

    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from kvserve.compose import build_service
    from scheduler.config import SchedulerConfig
    from server.config import ServerConfig

    service = build_service(EngineConfig(model=ModelConfig(num_threads=1, max_model_len=2048),
                                         cache=CacheConfig(kv_cache_memory_gib=0.25),
                                         scheduler=SchedulerConfig(max_num_seqs=32)),
                            ServerConfig(log_stats_interval_s=LOG_STATS_INTERVAL_S))
    engine, metrics, app = service.engine, service.metrics, service.app
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-metrics-tests", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", engine.model_name, metrics, engine)
    server.should_exit = True
    thread.join(30)
