#!/usr/bin/env bash
# CI's Python check (no GPU): lints the extension crate, installs the package from the clone exactly as users do
# (`pip install ./python`, maturin from PyPI), then runs the pytest suite. GPU tests skip.
set -euo pipefail
# Embed the committed PTX (src/driver/ptx/; refused if stale): no nightly needed, and .ci/run
# already checks that the pinned toolchain rebuilds it identically.
export CARVE_BUILD_KERNELS=${CARVE_BUILD_KERNELS:-0}
root=$(git rev-parse --show-toplevel)
cd "$root"
# The extension crate is its own cargo workspace (see python/Cargo.toml): lint it here.
(cd python && cargo fmt --check && CARGO_TARGET_DIR=../target/python cargo clippy --all-targets -- -D warnings)
venv=${CARVE_CI_VENV:-target/ci-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q ./python pytest numpy
# carve.dask's test runs a real distributed.LocalCluster.
"$venv/bin/python" -c 'import dask, distributed' 2>/dev/null || "$venv/bin/pip" install -q dask distributed
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests
