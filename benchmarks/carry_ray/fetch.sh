#!/usr/bin/env bash
# Builds .whl/ at the repository's root: what carries Ray 2.60 with its dashboard and Jobs API
# to the GPU machine (CPython 3.12, x86-64, no package registry, at most 64 MiB per call with
# the working tree). Ray's wheel (79 MB) is rewritten without what a Python-only cluster never
# loads (trim_ray.py: ray/jars, ray/rllib, ray/llm, the dashboard UI but a 4-file stub the
# dashboard head needs to start), 42 MB; the dashboard's Python dependencies that the GPU
# machine's image lacks come beside it (44 MiB in all). There:
#
#   eval "$(bash .whl/INSTALL.sh)"     # installs into /tmp/ray-site, sets PYTHONPATH and PATH
#
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/.whl
mkdir -p "$out/fallback"
grep -qx "/.whl/" "$root/.git/info/exclude" 2>/dev/null || echo "/.whl/" >> "$root/.git/info/exclude"
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$@"
}
scratch=$(mktemp -d)
get "$scratch" ray==2.60.0
python3 "$(dirname "$0")/trim_ray.py" "$scratch"/ray-2.60.0-*.whl "$out/$(basename "$scratch"/ray-2.60.0-*.whl)"
rm -rf "$scratch"
get "$out" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    rpds-py==2026.9.1 referencing==0.37.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    googleapis-common-protos==1.70.0 opencensus==0.11.4 opencensus-context==0.1.3 aiohttp-cors==0.8.1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2
get "$out/fallback" typing-extensions==4.16.0  # pydantic-core needs Sentinel (>= 4.14)
cp "$(dirname "$0")/INSTALL.sh" "$out/"
du -sh "$out"
