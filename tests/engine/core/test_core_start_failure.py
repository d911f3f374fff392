"""A core process that cannot start is reported with its own exit status and the reason in its log."""
from __future__ import annotations

import argparse

import pytest

from engine.core.process_client import MPEngineClient

pytestmark = pytest.mark.slow


def test_a_core_that_fails_to_start_reports_its_own_exit_status():
    from kvserve.cli import add_engine_args, build_engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    # Longer than the default model's context: LLMEngine refuses it after loading, the core exits 1.
    config, _ = build_engine_config(parser.parse_args(["--num-threads", "1", "--max-model-len", "1000000"]))
    client = MPEngineClient(config)
    with pytest.raises(RuntimeError, match=r"failed to start \(exit code 1\)"):
        client.start()
    assert client._proc is None and not client.is_healthy
