#!/usr/bin/env bash
# The aarch64 stage (Kunpeng hosts of Ascend servers), on an x86_64 Debian machine: cross-builds
# the Rust library, its CLI and the C tests for aarch64-unknown-linux-gnu with the CMake toolchain
# cmake/aarch64-linux-gnu.cmake, checks that the headers it regenerates are the committed ones,
# and runs ctest under qemu user emulation: the C tests (shared and static library, headers
# alone and beside other headers, CANN declarations, install + find_package, the C++ trainer)
# and `cargo test --release` for the target. The torch op library and the Python suite are
# host-only (not built here). Installs what it needs when missing: the Rust target (rustup),
# the cross compilers, the target's libc and qemu (apt), cmake and ninja.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
readonly TARGET=aarch64-unknown-linux-gnu BUILD_DIR=build-aarch64 SYSROOT=/usr/aarch64-linux-gnu
start=$SECONDS

rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
[ -e "$SYSROOT/lib/libc.so.6" ] || need+=(libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  --toolchain "$PWD/cmake/aarch64-linux-gnu.cmake" >/dev/null
cmake --build "$BUILD_DIR" -j2
# build.rs regenerated the headers while building for aarch64: they must be the committed ones.
git diff --exit-code -- include/ || { echo "aarch64: the headers generated for aarch64 differ" >&2; exit 1; }

status=0
timeout 1500 ctest --test-dir "$BUILD_DIR" --output-on-failure || status=$?

# cargo's counts, from ctest's log of the cargo_test run.
read -r passed failed ignored < <(awk '/^test result:/ { for (i = 2; i <= NF; i++) {
    if ($i == "passed;") p += $(i-1); if ($i == "failed;") f += $(i-1); if ($i == "ignored;") g += $(i-1) } }
    END { print p + 0, f + 0, g + 0 }' "$BUILD_DIR/Testing/Temporary/LastTest.log")
echo "aarch64 summary ($((SECONDS - start)) s): headers identical to the committed ones;" \
  "cargo test under qemu: $passed passed, $failed failed, $ignored ignored; ctest exit status $status (summary above)"
exit "$status"
