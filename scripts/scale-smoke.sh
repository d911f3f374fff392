#!/usr/bin/env bash
# Scale-out smoke on one machine: two single-threaded kvserve replicas behind sglang-router.
#
#   scripts/scale-smoke.sh                 # cache-aware vs round-robin, then failover (real model)
#   scripts/scale-smoke.sh --throughput    # + 2 replicas via the router vs 1 replica, output tok/s
#                                          #   (each replica pinned to a core of its own; --pin off, --cores 0,1,2,3)
#   scripts/scale-smoke.sh --model DIR     # any checkpoint kvserve serves
#
# Needs `pip install -e '.[dev]'` (sglang-router comes with it). Every process binds to
# 127.0.0.1 on a free port and is stopped on exit; logs stay in the folder printed at the end.
# All options: python -m bench.scale --help. Exit status 0 only when every step PASSes.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import sglang_router" 2>/dev/null || { echo "scale-smoke: pip install -e '.[dev]' (sglang-router)" >&2; exit 2; }
exec python -m bench.scale "$@"
