#!/usr/bin/env bash
# Sets up everything the project needs on a fresh Debian machine and builds it:
# cmake + ninja (apt, only if missing), a Python venv with the pinned requirements,
# the Rust library (cargo) and the CMake tree (C tests, and the torch op library when present).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[setup] $*" >&2; }

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
if ((${#need[@]})); then
  step "installing ${need[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"

pip_quiet=-q  # a fresh environment shows pip's downloads: minutes of them the first time
[ -x .venv/bin/python ] || { step "creating the Python environment .venv"; python3 -m venv .venv; pip_quiet=; }
step "Python packages (requirements-dev.txt: torch, transformers, ...; the first run downloads about 3 GB)"
.venv/bin/pip install $pip_quiet --disable-pip-version-check -r requirements-dev.txt
# LlamaFactory pins transformers <= 5.8.0: a second copy (with its dependencies) that the ctest
# entry pytest_transformers_5_8 puts first on PYTHONPATH, to run the engine tests against it too.
if [ ! -d .venv/transformers-5.8 ]; then
  step "transformers 5.8.0 beside the pinned one (.venv/transformers-5.8)"
  .venv/bin/pip install -q --disable-pip-version-check --target .venv/transformers-5.8 transformers==5.8.0
fi
# LlamaFactory's v1 trainer, the real consumer the ctest entry llamafactory_trainer runs on our
# package: its own folder (--no-deps, exactly the modules v1 imports), reinstalled when the pins change.
if ! cmp -s tests/llamafactory/requirements.txt .venv/llamafactory/.requirements; then
  step "LlamaFactory's v1 trainer (.venv/llamafactory)"
  rm -rf .venv/llamafactory
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/llamafactory \
    -r tests/llamafactory/requirements.txt
  cp tests/llamafactory/requirements.txt .venv/llamafactory/.requirements
fi
# verl's engine, the real consumer of fsdp_turbo's standalone API that the ctest entry verl_engine
# runs on our package: its own folder, installed the same way.
if ! cmp -s tests/verl/requirements.txt .venv/verl/.requirements; then
  step "verl's engine (.venv/verl)"
  rm -rf .venv/verl
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/verl -r tests/verl/requirements.txt
  cp tests/verl/requirements.txt .venv/verl/.requirements
fi

step "building the Rust library, the C tests and the torch op library (build/; the first build takes about 5 minutes)"
configure_log=$(mktemp)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PWD/.venv/bin/python" \
  >"$configure_log" 2>&1 || { cat "$configure_log" >&2; exit 1; }
rm -f "$configure_log"
cmake --build build -j2
