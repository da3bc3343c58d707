#!/usr/bin/env bash
# Runs NVIDIA compute-sanitizer (memcheck, racecheck, synccheck) over the staged GPU test
# binaries of the device heap and the suballocators, and prints one summary line per binary and
# tool. Logs go to $OUT/sanitizer (or ./sanitizer-logs). Exit status: non-zero if any tool
# reported an error or a test failed under it.
#
#   here:            ../shared/tools/gpu-stage        (stages .gpu/bin/*)
#   GPU machine:     bash tests/gpu/sanitize.sh [BINARY_FILTER...]
#   SANITIZE_TIMEOUT=SECS stops each binary-and-tool run after SECS (reported as rc=124).
#
# Default binaries: device_heap_gpu, divergent_warps_gpu, kernel_alloc_gpu, general_heap_gpu,
# heap_growth_gpu, suballocators_gpu, foreign_heap, interop_cuda_cpp_gpu.
# Summaries belong in RELIABILITY.md.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
bin=.gpu/bin
logs=${OUT:-.}/sanitizer
[ -n "${OUT:-}" ] || logs=sanitizer-logs
mkdir -p "$logs"
if ! command -v compute-sanitizer >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer /opt/cuda/bin; do
    [ -x "$d/compute-sanitizer" ] && PATH="$d:$PATH"
  done
fi
command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found"; exit 2; }
[ -d "$bin" ] || { echo "no $bin: run ../shared/tools/gpu-stage first"; exit 2; }

filters=("$@")
[ ${#filters[@]} -gt 0 ] || filters=(device_heap_gpu divergent_warps_gpu kernel_alloc_gpu general_heap_gpu heap_growth_gpu suballocators_gpu foreign_heap interop_cuda_cpp_gpu)
export CARVE_REQUIRE_GPU=1 RUST_BACKTRACE=1
compute-sanitizer --version | head -n 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

status=0
for f in "${filters[@]}"; do
  for exe in "$bin"/"$f"-*; do
    [ -x "$exe" ] || continue
    name=$(basename "$exe")
    for tool in memcheck racecheck synccheck; do
      extra=()
      case $tool in
        memcheck) extra=(--leak-check full --padding 32) ;;
        racecheck) extra=(--racecheck-report all) ;;
      esac
      log="$logs/$name.$tool.log"
      start=$(date +%s)
      timeout "${SANITIZE_TIMEOUT:-0}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 \
        --target-processes all "$exe" --test-threads=1 >"$log" 2>&1
      rc=$?
      secs=$(( $(date +%s) - start ))
      summary=$(grep -E '(ERROR|RACECHECK|LEAK) SUMMARY' "$log" | tail -n 2 | tr '\n' ' ')
      tests=$(grep -E '^test result:' "$log" | tail -n 1)
      [ -n "$summary" ] || summary="(no sanitizer summary line)"
      # A binary whose tests make no CUDA call (foreign_heap decodes heaps on the host) leaves
      # the tool nothing to check: it says so and exits 255. That is not a finding, provided
      # the tests passed.
      if [ "$rc" -eq 255 ] && grep -q 'terminated before first instrumented API call' "$log" \
        && grep -q '^test result: ok' "$log"; then
        summary="(no CUDA API call: nothing to check)"
        rc=0
      fi
      echo "$name $tool: rc=$rc ${secs}s; $summary; ${tests:-no test result line}"
      if [ "$rc" -ne 0 ]; then
        status=1
        grep -E '^=========' "$log" | head -n 30
      fi
    done
  done
done
echo "logs in $logs"
exit $status
