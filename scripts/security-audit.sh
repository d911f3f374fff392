#!/usr/bin/env bash
# The security audit of docs/security.md: bandit on the product's code, pip-audit on the
# dependency set kvserve runs with.
#
#   scripts/security-audit.sh            # both
#   scripts/security-audit.sh bandit     # the code only (offline)
#   scripts/security-audit.sh pip-audit  # the dependencies only (needs a vulnerability service)
#
# bandit reads its configuration (the justified skips) from pyproject.toml's [tool.bandit]; every
# other finding is fixed or carries `# nosec BNNN` under a `# bandit BNNN: why` comment.
#
# pip-audit audits the exact versions installed here of kvserve's runtime dependency closure
# (the project has no lock file: this environment's resolution is the set that is tested), plus
# the dev extra's with EXTRAS=dev. It needs PyPI's per-version JSON API (or OSV with
# PIP_AUDIT_SERVICE=osv); when that cannot be reached it says so and exits 2, so "not audited"
# never reads as "no known vulnerabilities".
#
# Exit status: 0 clean, 1 findings, 2 could not audit. Not part of the test run: pip-audit needs
# the network, and bandit's verdict is a review, not a test.
set -uo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
EXTRAS="${EXTRAS:-}"
status=0

run_bandit() {
    echo "== bandit (pyproject.toml [tool.bandit]) on kvtypes cache scheduler engine server kvserve"
    if ! command -v bandit >/dev/null; then
        echo "bandit is not installed (pip install bandit)"; return 2
    fi
    local out rc
    out="$(bandit -c pyproject.toml -r kvtypes cache scheduler engine server kvserve -q 2>&1)"
    rc=$?
    # bandit places a multi-line call's finding on another line than its nosec and warns
    grep -v "nosec encountered" <<<"$out"
    [ $rc -eq 0 ] && echo "bandit: no issues" || echo "bandit: findings (exit $rc)"
    [ $rc -eq 0 ] || return 1
}

run_pip_audit() {
    echo "== pip-audit on kvserve's installed dependency closure${EXTRAS:+ (extras: $EXTRAS)}"
    if ! command -v pip-audit >/dev/null; then
        echo "pip-audit is not installed (pip install pip-audit)"; return 2
    fi
    local reqs out
    reqs="$(mktemp --suffix=.txt)"
    out="$(mktemp)"
    # shellcheck disable=SC2086
    python - ${EXTRAS//,/ } >"$reqs" <<'EOF' || return 2
"""kvserve's installed dependency closure as exact pins (the extras named on the command line)."""
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

seen, todo = {}, [("kvserve", frozenset(sys.argv[1:]))]
while todo:
    name, extras = todo.pop()
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        print(f"# not installed: {name}", file=sys.stderr)
        continue
    key = canon(dist.metadata["Name"])
    if key in seen and extras <= seen[key][1]:
        continue
    seen[key] = (dist.version, extras | seen.get(key, ("", frozenset()))[1])
    envs = [{"extra": e} for e in extras] or [{"extra": ""}]
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            todo.append((req.name, frozenset(req.extras)))
for key in sorted(seen):
    if key != "kvserve":
        # a local version (torch's +cpu) is the public release's build: its advisories apply
        print(f"{key}=={seen[key][0].split('+')[0]}")
EOF
    echo "$(wc -l <"$reqs") packages"
    pip-audit -r "$reqs" --no-deps --disable-pip --progress-spinner off \
        -s "${PIP_AUDIT_SERVICE:-pypi}" >"$out" 2>&1
    local rc=$?
    local total unaudited
    total=$(wc -l <"$reqs")
    unaudited=$(grep -c "could not be audited" "$out" || true)
    if grep -qE "ConnectionError|NameResolutionError|Max retries exceeded" "$out" || [ "$unaudited" -ge "$total" ]; then
        echo "pip-audit: the vulnerability service (${PIP_AUDIT_SERVICE:-pypi}) could not be reached or knows none of"
        echo "the $total packages ($unaudited unaudited): NOT AUDITED. Run this where pypi.org's per-version JSON API"
        echo "(or api.osv.dev with PIP_AUDIT_SERVICE=osv) answers."
        rm -f "$reqs" "$out"
        return 2
    fi
    grep -v -e "could not be audited" -e "^WARNING:pip_audit" "$out" | tail -40
    [ "$unaudited" -gt 0 ] && echo "pip-audit: $unaudited of $total packages could not be audited (not on PyPI?)"
    rm -f "$reqs" "$out"
    return $rc
}

# findings (1) outrank "could not audit" (2), which outranks clean (0)
worst() {
    if [ "$1" -eq 1 ] || [ "$status" -eq 1 ]; then status=1; elif [ "$1" -eq 2 ]; then status=2; fi
}

if [ "$what" = all ] || [ "$what" = bandit ]; then
    run_bandit; worst $?
fi
if [ "$what" = all ] || [ "$what" = pip-audit ]; then
    run_pip_audit; worst $?
fi
exit "$status"
