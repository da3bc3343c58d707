#!/usr/bin/env bash
# Drops the staged binaries that never touch a GPU from .gpu/ (after ../shared/tools/gpu-stage),
# so that the staged folder and the tree fit the device tool's 64 MiB carry. They run in
# `cargo test` on any machine.
#
#   ../shared/tools/gpu-stage && bash tests/gpu/lean-stage.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.gpu"
cpu_only=(fuzz conformance_cpu carve_bench replay replay_observe lockstep_warp general_heap
  bump_block slab_contention heap_stress global_alloc carve_kernels heap_loom
  suballocator_models suballocator_behaviour suballocator_stress adaptors bounded_memory
  fault_injection logging_failures no_gpu order_faults_fixed_size order_faults_pool_arena
  order_faults_vm per_thread_streams pool_arena_failures snapshot teardown_errors vm_teardown c_abi
  hostile divergent_warps carve_lab)
for t in "${cpu_only[@]}"; do
  rm -f bin/"$t"-*
  sed -i "/ $t-/d" manifest
done
du -sh . | sed 's/^/staged: /'
wc -l < manifest | sed 's/^/binaries: /'
