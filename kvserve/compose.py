"""The composition root: configuration in, a ready engine client + metrics + app out.

``build_service`` is the only place where the layers are wired together. The CLI (``kvserve
serve``), the tests and the benches (through the CLI) all call it, so what is tested is what is
served.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.core.client import EngineClient, InprocEngineClient
from engine.core.process_client import MPEngineClient
from engine.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig
from server import metrics_compat
from server.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass
class Service:
    engine: EngineClient  # started: the model is loaded and the core is stepping
    metrics: Metrics
    app: Any  # the FastAPI app
    config: ServerConfig


def build_service(engine_config: EngineConfig, server_config: ServerConfig, engine: Any | None = None) -> Service:
    """Start the engine (``engine_config.core.mode``) and build metrics and the app around it.

    ``engine``: an ``LLMEngine`` to serve in thread mode (tests with tiny models); by default
    one is built from ``engine_config``. In process mode the core process loads the model, and
    this (frontend) process keeps torch to one thread: it only tokenizes and formats.
    """
    client: EngineClient
    if engine_config.core.mode == "process" and engine is None:
        import torch

        torch.set_num_threads(1)
        client = MPEngineClient(engine_config, log_format=server_config.log_format)
    else:
        if engine is None:
            from engine.llm_engine import LLMEngine

            engine = LLMEngine(engine_config)
        client = InprocEngineClient(engine)
    client.start()
    metrics = Metrics(client.info)
    metrics_compat.enable(metrics, server_config.metrics_compat)  # before the app serves /metrics
    client.observer = metrics
    app = build_app(client, server_config, metrics)
    logger.info("engine core: %s mode", "process" if isinstance(client, MPEngineClient) else "thread")
    return Service(client, metrics, app, server_config)
