#!/usr/bin/env bash
# Builds the carve wheel here (Rust needed) and stages it, with the GPU tests, the ported
# example and the Python benchmarks, for the GPU machine (Python, torch, CuPy, numba; no Rust).
# The wheel is manylinux_2_28 and abi3 (CPython >= 3.9): it installs without Rust on any Linux
# with glibc >= 2.28. It links no CUDA library (carve loads libcuda at run time), so one wheel
# serves CUDA 12 and 13 drivers.
#
#   python/tools/build_wheel.sh [OUT]          # default OUT: .gpu-python (git-excluded)
#   device run: carry [".gpu-python"], command "bash .gpu-python/run.sh 2>&1 | tee $OUT/python.log"
#   (bash .gpu-python/run.sh --no-bench runs the tests only)
set -euo pipefail
# Embed the committed PTX (src/driver/ptx/; refused if stale): no nightly needed, and .ci/run
# already checks that the pinned toolchain rebuilds it identically.
export CARVE_BUILD_KERNELS=${CARVE_BUILD_KERNELS:-0}
root=$(git rev-parse --show-toplevel)
cd "$root"
out=${1:-.gpu-python}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"

venv=${CARVE_BUILD_VENV:-target/python-venv}
if [ ! -x "$venv/bin/maturin" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "maturin>=1.5,<2"
fi
policy=manylinux_2_28
# A host glibc newer than the policy's would leak newer symbol versions into the binary: link
# with zig against glibc 2.28 instead (ziglang from PyPI; maturin finds it on PATH).
zig=()
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
if [ -n "$glibc" ] && [ "$(printf '%s\n' 2.28 "$glibc" | sort -V | tail -1)" != 2.28 ]; then
  "$venv/bin/python" -c 'import ziglang' 2>/dev/null || "$venv/bin/pip" install -q ziglang
  zig=(--zig)
fi
rm -rf "$out"
mkdir -p "$out/wheels" "$out/deps" "$out/python" "$out/bench" "$out/examples"
find python/carve -name __pycache__ -prune -exec rm -rf {} +
PATH="$(cd "$venv/bin" && pwd):$PATH" CARGO_TARGET_DIR="$root/target/python" "$venv/bin/maturin" build \
  --release --strip --compatibility "$policy" ${zig[@]+"${zig[@]}"} -m python/Cargo.toml -o "$out/wheels"
# pytest for the GPU machine in case it lacks it (it has no network). python3's own pip: the
# build venv's scripts point at the interpreter that made it, which may be gone.
python3 -m pip download -q -d "$out/deps" --only-binary=:all: --python-version 3.9 pytest exceptiongroup tomli \
  || echo "warning: could not download pytest; the GPU machine must have it" >&2
# dask and distributed (with their dependencies) for carve.dask's GPU test: the GPU machine's
# Python is 3.12 and lacks them.
python3 -m pip download -q -d "$out/deps" --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 dask distributed \
  || echo "warning: could not download dask; carve.dask's GPU test will fail there" >&2

cp -r python/tests "$out/python/"
cp -r include "$out/"
cp -r lab/bench/python "$out/bench/"
cp examples/numba_heap.py "$out/examples/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: installs the carve wheel next to the system's torch, CuPy and numba, runs every Python test with CARVE_REQUIRE_GPU=1 (a GPU test that would skip fails),
# then the Python benchmarks (unless --no-bench). Exits non-zero if the tests fail.
cd "$(dirname "$0")" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# The machine's python3 is itself a venv (with torch, CuPy, numba): a venv made from it would
# see only the base interpreter's packages. Install beside it instead.
py=python3
site=$(mktemp -d)
$py -m pip install -q --no-index --no-deps --no-compile --target "$site" wheels/carve-*.whl || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
$py -c 'import pytest' 2>/dev/null || $py -m pip install -q --no-index --find-links deps pytest || exit 1
$py -c 'import dask, distributed' 2>/dev/null || $py -m pip install -q --no-index --find-links deps dask distributed || exit 1
$py -c 'import torch, cupy, numba; print("torch", torch.__version__, "| cupy", cupy.__version__, "| numba", numba.__version__)'
export CARVE_REQUIRE_GPU=1 PYTHONDONTWRITEBYTECODE=1
$py -m pytest -q -rs -p no:cacheprovider python/tests
status=$?
if [ "${1:-}" != "--no-bench" ]; then
  $py bench/python/random_allocations.py --n 1000 10000 100000 --passes 3
  $py bench/python/transformer_step.py --steps 200 --rounds 3
fi
exit $status
RUN
chmod +x "$out/run.sh"
echo "staged $(ls "$out/wheels") in $out/ ($(du -sh "$out" | cut -f1)); carry [\"$out\"], run: bash $out/run.sh"
