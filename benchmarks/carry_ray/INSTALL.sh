#!/usr/bin/env bash
# Installs Ray 2.60.0 (trimmed: no ray/jars, ray/rllib, ray/llm, and only a 4-file stub of the
# dashboard UI, which the dashboard head needs in order to start) and the dashboard's Python
# dependencies from the wheels next to this file into RAY_SITE (default /tmp/ray-site), for
# CPython 3.12 on x86-64 Linux, with no package registry: enough for `ray start --head
# --include-dashboard=true`, the Jobs API (JobSubmissionClient submit/logs/tail/stop) and
# ray.util.state against the dashboard.
#
#   eval "$(bash .whl/INSTALL.sh)"     # installs, then sets PYTHONPATH and PATH in this shell
#
# Progress and errors go to stderr; stdout carries only the two `export` lines. Exit status is
# non-zero if the installation or the import check at the end fails.
set -euo pipefail

WHL_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SITE=${RAY_SITE:-/tmp/ray-site}
PY=${PYTHON:-python3}
PY_PATH=$(command -v "$PY") || { echo "INSTALL.sh: $PY not found" >&2; exit 1; }
log() { echo "INSTALL.sh: $*" >&2; }

wheels=("$WHL_DIR"/*.whl)
# pydantic-core 2.50 imports typing_extensions.Sentinel (typing_extensions >= 4.14); add the
# carried typing_extensions 4.16.0 only when the machine's own is older or missing.
if ! "$PY" -c 'from typing_extensions import Sentinel' >/dev/null 2>&1; then
    log "typing_extensions lacks Sentinel: adding fallback/typing_extensions-4.16.0"
    wheels+=("$WHL_DIR"/fallback/typing_extensions-*.whl)
fi

log "installing ${#wheels[@]} wheels into $SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" >&2

# The wheel keeps the executable bits (pip restores them); this only guards against a copy
# that lost them.
chmod +x "$SITE/ray/core/src/ray/gcs/gcs_server" "$SITE/ray/core/src/ray/raylet/raylet"

# Byte-compile in parallel: with --no-compile (and PYTHONDONTWRITEBYTECODE=1) every Ray
# process compiles its imports from source at each start; on a busy machine the dashboard
# agent then started too late and the raylet aborted ("Timed out waiting for file
# .../dashboard_agent_listen_port_..."). Failures here are harmless.
"$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true

# The job entrypoint `python ...` runs with the PATH of `ray start`: make `python` the same
# interpreter as python3 (a wrapper, not a symlink: a symlink to a virtualenv's python3 would
# lose that virtualenv's site-packages).
want=$("$PY" -c 'import sys; print(sys.prefix)')
have=$(PATH="${PATH}" python -c 'import sys; print(sys.prefix)' 2>/dev/null || true)
mkdir -p "$SITE/bin"
if [[ "$have" != "$want" ]]; then
    log "creating $SITE/bin/python -> $PY_PATH (python was: ${have:-missing})"
    printf '#!/bin/sh\nexec %q "$@"\n' "$PY_PATH" >"$SITE/bin/python"
    chmod +x "$SITE/bin/python"
fi

# Check that what the dashboard head and agent import is importable.
if ! out=$(cd / && PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import ray, ray.dashboard.optional_deps, ray.dashboard.head, ray.dashboard.agent
import ray.dashboard.modules.reporter.reporter_agent, ray.dashboard.modules.job.job_head
import ray.job_submission, ray.util.state
print(ray.__version__)' 2>&1); then
    log "import check FAILED:"; echo "$out" | tail -n 5 >&2; exit 1
fi
log "ray $(tail -n 1 <<<"$out") importable from $SITE"

echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\""
echo "export PATH=\"$SITE/bin:\$PATH\""
