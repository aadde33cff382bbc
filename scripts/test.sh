#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole regression suite: format and lint
# checks, the header drift check, then ctest (C tests, cargo test, Python tests, the demo, the
# parity tests again on the AVX2 and portable paths), then the aarch64 stage under qemu
# (scripts/test_aarch64.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 CARGO_TERM_COLOR=never HF_HUB_OFFLINE=1

scripts/setup.sh
cargo fmt --check
cargo clippy --release --all-targets --locked -- -D warnings
# build.rs regenerates the header; the committed copy must be the generated one.
git diff --exit-code -- include/ || { echo "include/*.h are stale: commit the regenerated headers" >&2; exit 1; }
# The Python package's ctypes layer is generated from those headers (scripts/gen_ctypes.py).
python3 scripts/gen_ctypes.py --check
timeout 3000 ctest --test-dir build --output-on-failure
scripts/test_aarch64.sh
