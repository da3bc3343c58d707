#!/usr/bin/env bash
# CI's Python check (no GPU): installs the package from the clone exactly as users do
# (`pip install ./python`, maturin from PyPI), then runs the pytest suite. GPU tests skip.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
venv=${CARVE_CI_VENV:-target/ci-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q ./python pytest numpy
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
