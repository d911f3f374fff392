#!/usr/bin/env bash
# The GPU check, in one call of about 8 minutes on an H200 machine (run from the repo root):
#   (a) tests/gpu: kvserve's logits equal transformers' on the GPU for tiny random Llama
#       configs, per attention backend, CUDA graphs on and off, a prefix hit, chunked
#       prefill, a preemption, the profiled KV pool, and the Triton kernels at real shapes;
#   (b) throughput on a Llama-3.1-8B-shaped model with random bf16 weights: 256 requests,
#       prompt/output lengths uniform in 100-1024, in-process and over HTTP at concurrency 64;
#   (c) transformers generate on the same GPU and a subset of the same requests.
# Report: $OUT/gpu-h200.{json,md} (commit the .md as docs/bench/gpu-h200.md), plus logs.
#
#   scripts/fetch-gpu-wheels.sh        # first, on a machine with network: wheels the image lacks
#   scripts/gpu-check.sh               # on the GPU machine (no network needed)
#   scripts/gpu-check.sh --smoke       # anywhere: tiny model on the CPU, proves the plumbing
#
# Environment: OUT (default bench/results/gpu-check), KVSERVE_GPU_WHEELS (default
# wheelhouse-gpu), GPU_TESTS_TIMEOUT (s, default 270: the first H200 run took ~215 s, mostly Triton compiles),
# BENCH_TIMEOUT (s, default 270). A device call should allow 580 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-check}
WHEELS=${KVSERVE_GPU_WHEELS:-wheelhouse-gpu}
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
log() { echo "[gpu-check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/gpu-check.log"; }

# 0. What the image lacks, from the wheelhouse only (never torch: nothing here depends on it).
MISSING=$(python - <<'PY'
import importlib.util
need = {"fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic", "gguf": "gguf",
        "prometheus_client": "prometheus-client", "httpx": "httpx", "yaml": "pyyaml",
        "safetensors": "safetensors", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [[ -n "$MISSING" ]]; then
  log "installing from $WHEELS: $MISSING"
  if ! python -m pip install --quiet --no-index --find-links "$WHEELS" $MISSING >>"$OUT/gpu-check.log" 2>&1; then
    log "error: could not install $MISSING from $WHEELS (run scripts/fetch-gpu-wheels.sh first)"
    exit 2
  fi
fi
python - <<'PY' 2>&1 | tee -a "$OUT/gpu-check.log"
import torch, transformers
import importlib.util
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "transformers", transformers.__version__,
      "triton", __import__("triton").__version__ if importlib.util.find_spec("triton") else None,
      "flash_attn", importlib.util.find_spec("flash_attn") is not None)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "GiB")
PY
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

# (a) correctness on the device
log "(a) tests/gpu"
timeout "${GPU_TESTS_TIMEOUT:-270}" python -m pytest -q -p no:cacheprovider tests/gpu --maxfail 10 --timeout 120 \
  --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1
TESTS_RC=$?
tail -n 15 "$OUT/gpu-tests.log" | tee -a "$OUT/gpu-check.log"
log "(a) exit code $TESTS_RC"

# (b) + (c) throughput; the report is rewritten after every phase, so a timeout keeps what ran
if [[ $SMOKE == 1 ]]; then
  BENCH=(--smoke --device cpu --num-requests 6 --hf-requests 2 --batch1-tokens 4)
else
  BENCH=()
fi
log "(b, c) bench.gpu_check ${BENCH[*]}"
timeout "${BENCH_TIMEOUT:-270}" python -m bench.gpu_check "${BENCH[@]}" --out "$OUT" --name gpu-h200 \
  >"$OUT/bench.log" 2>&1
BENCH_RC=$?
grep -A8 "^## Targets" "$OUT/gpu-h200.md" 2>/dev/null | tee -a "$OUT/gpu-check.log"
log "(b, c) exit code $BENCH_RC; report $OUT/gpu-h200.md"
[[ $TESTS_RC == 0 && $BENCH_RC == 0 ]]
