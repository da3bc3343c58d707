#!/usr/bin/env bash
# Miri over the host crate's unsafe code, through tests that run on host memory and never call
# the CUDA driver (Miri cannot dlopen it): the fixed-size slab table and its lock-free stack, the
# pool and its shards, the arena, host memory, the fault-injecting and statistics adaptors, the
# option bounds, and the C ABI (handles, frees, panics). The coalescing index has no unsafe code
# and its randomised tests run for many minutes each under Miri: the ordinary test run covers it.
#
#   bash tests/tools/miri-host.sh        # the whole selection (about 6 minutes on 2 cores)
#   bash tests/tools/miri-host.sh --ci   # the part .ci/run runs (about 2 minutes on 2 cores)
#
# Left out: tests that spawn processes, write files or compile C (Miri's isolation refuses
# them), tests that ask whether a GPU is present, the stack's 4-thread x 20,000-round hammer
# (the loom model covers its interleavings; under Miri it runs far too long), and the 512 MiB
# growth test.
set -euo pipefail
cd "$(dirname "$0")/../.."
toolchain=${CARVE_MIRI_TOOLCHAIN:-nightly-2026-10-30}
rustup toolchain install "$toolchain" --profile minimal --component miri,rust-src
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-permissive-provenance}"
# One build of carve serves its tests and the C ABI.
miri() { CARGO_TARGET_DIR="target/miri-$toolchain" cargo +"$toolchain" miri test -q "$@"; }

capi_skips=(--skip c_program --skip need_a_device --skip every_suballocator)

if [[ ${1:-} == --ci ]]; then
  miri -p carve --lib -- \
    resource::fixed_size resource::pool resource::limits --skip threads_never_pop
  miri -p carve --test suballocator_behaviour -- --exact \
    fixed_size_refuses_what_it_cannot_serve_and_hands_streams_over_once \
    fixed_size_hands_sealed_blocks_over_with_one_wait_on_the_last_mark \
    a_block_freed_on_another_stream_is_reused_after_one_event_wait
  miri -p carve-capi --lib --test hostile --test c_abi -- "${capi_skips[@]}"
  exit 0
fi

miri -p carve --lib -- \
  resource::fixed_size resource::pool resource::limits resource::host resource::simulated \
  adaptor::fault_injection adaptor::statistics --skip threads_never_pop
miri -p carve --test suballocator_behaviour -- --skip growth_stops_doubling
miri -p carve-capi --lib --test hostile --test c_abi -- "${capi_skips[@]}"
