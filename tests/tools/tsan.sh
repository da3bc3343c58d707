#!/usr/bin/env bash
# ThreadSanitizer over the multi-threaded CPU tests: the suballocator stress test (16 threads on
# pool, fixed-size, arena, binning and the expandable pool over host memory), the lock-free
# pieces' thread tests, and the C ABI's destroy racing other threads' calls. The standard library
# is rebuilt with the sanitizer (-Zbuild-std), so its locks and atomics are seen too.
#
#   bash tests/tools/tsan.sh            # about 4 minutes on 2 cores, most of it the build
#
# Any reported race fails the run (halt_on_error).
set -euo pipefail
cd "$(dirname "$0")/../.."
toolchain=${CARVE_TSAN_TOOLCHAIN:-nightly-2026-10-30}
rustup toolchain install "$toolchain" --profile minimal --component rust-src
target=$(rustc +"$toolchain" -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Zsanitizer=thread" RUSTDOCFLAGS="-Zsanitizer=thread"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
export CARGO_TARGET_DIR=target/tsan-$toolchain
tsan() { cargo +"$toolchain" test -Zbuild-std --target "$target" "$@"; }
tsan -p carve --test suballocator_stress
tsan -p carve --lib -- threads
tsan -p carve-capi --test hostile -- destroy_racing
