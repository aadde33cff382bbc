#!/usr/bin/env bash
# GPU check of the CUDA backends, in one go, for a GPU host with torch + CUDA, nvcc, cmake and
# ninja (no Rust needed, no network). Build the Rust library on an x86_64 machine with Rust,
# copy the checkout to the GPU host with that library in place, and run the check there:
#
#   cargo build --release                       # on the build machine: target/release/libfsdpturbo.so
#   bash scripts/device_check.sh                # on the GPU host, in the copied checkout
#
# Steps (each prints PASS/FAIL): build the op library against this host's torch (CMake with
# FSDPTURBO_BUILD_RUST=OFF; torch.utils.cpp_extension as a fallback), the GPU tests
# (tests/python/test_cuda_ops.py: every kernel vs torch on fresh random data, grouped GEMM
# forward/backward on each path, grad norm, a one-rank NCCL communicator through our loader and
# the deadline of a two-rank one whose peer never joins), the
# capacity-bounded dispatch (tests/python/test_cuda_graph.py: no host sync, one CUDA graph of
# forward + backward replayed equal to eager, fullgraph compile),
# the CPU-side backend tests, the C++ trainer through NCCL (one rank), then the benchmark tables
# (benches/cuda_moe.py; benches/moe_modes.py: compiled vs eager, capacity vs dropless, CUDA-graph
# replay vs eager launch). Logs and the benchmark JSON go to $OUT when set. Exit 1 on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
FAILED=()
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
export FSDPTURBO_KERNEL_CACHE=/tmp/fsdpturbo-kernels

step() { # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "PASS  $name ($(( $(date +%s) - t0 )) s)"
  else
    local rc=$?
    echo "FAIL  $name (exit $rc, $(( $(date +%s) - t0 )) s); last lines of $name.log:"
    tail -n 25 "$OUT/$name.log" | sed 's/^/      /'
    FAILED+=("$name")
  fi
}

if [[ ! -f target/release/libfsdpturbo.so ]]; then
  echo "FAIL  target/release/libfsdpturbo.so is missing: build it with cargo on the CPU machine and carry it"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

build_cmake() {
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDPTURBO_BUILD_RUST=OFF \
        -DPython3_EXECUTABLE="$(command -v $PY)" &&
  cmake --build build-device --target fsdpturbo_torch -j 16 &&
  cp build-device/torch_ext/libfsdpturbo_torch.so "$OPLIB"
}
build_cpp_extension() {
  $PY - <<'EOF'
import glob, os, shutil, torch.utils.cpp_extension as ext
root = os.getcwd()
path = ext.load(name="fsdpturbo_torch", sources=sorted(glob.glob("torch_ext/csrc/*.cpp")),
                extra_include_paths=[f"{root}/include", f"{root}/torch_ext/csrc"], extra_cflags=["-O2", "-std=c++20"],
                extra_ldflags=[f"-L{root}/target/release", "-lfsdpturbo", f"-Wl,-rpath,{root}/target/release"],
                is_python_module=False, build_directory="/tmp", verbose=True)
shutil.copy(path if isinstance(path, str) else "/tmp/fsdpturbo_torch.so", os.environ["OPLIB"])
EOF
}
ln -sf libfsdpturbo.so target/release/libfsdpturbo.so.0
export OPLIB=/tmp/libfsdpturbo_torch.so
rm -f "$OPLIB"
step build_op_library build_cmake
if [[ ! -f $OPLIB ]]; then
  step build_op_library_cpp_extension build_cpp_extension
fi
if [[ ! -f $OPLIB ]]; then
  echo "FAIL  no op library: nothing else can run"; exit 1
fi
export FSDPTURBO_LIB=$ROOT/target/release/libfsdpturbo.so FSDPTURBO_TORCH_LIB=$OPLIB
export PYTHONPATH=$ROOT/torch_ext/python LD_LIBRARY_PATH=$ROOT/target/release:${LD_LIBRARY_PATH:-}

step gpu_tests $PY -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_ops.py
step cuda_graph_capacity $PY -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_graph.py
step backend_tests $PY -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_backend.py

trainer() {
  NCCL_LIB=$($PY -c "import pathlib, nvidia; print(next(str(d) for p in nvidia.__path__ for d in pathlib.Path(p).glob('*/lib/libnccl.so.2')))")
  c++ -std=c++17 -O1 -Wall -Werror -Iinclude examples/cpp_trainer/main.cpp -Ltarget/release -lfsdpturbo \
      -Wl,-rpath,$ROOT/target/release -o /tmp/cpp_trainer &&
  FSDPTURBO_TRAINER_COMM=nccl FSDPTURBO_NCCL_PATH=$NCCL_LIB WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 \
    /tmp/cpp_trainer examples/configs/qwen3_30b_a3b_ep8.yaml examples/models/qwen3_30b_a3b.json --world 32 --rank 5
}
step cpp_trainer_nccl trainer

step benchmark $PY benches/cuda_moe.py --quick --json "$OUT/bench.json"
step benchmark_modes $PY benches/moe_modes.py --device cuda --dtype bfloat16
echo
echo "== benchmark ($(date -u +%Y-%m-%dT%H:%MZ)) =="
sed -n '/^device /,$p' "$OUT/benchmark.log"
echo "== compile, capacity and CUDA-graph modes =="
grep -v -i warn "$OUT/benchmark_modes.log"
echo
echo "total $(( $(date +%s) - START )) s"
if (( ${#FAILED[@]} )); then
  echo "FAILED: ${FAILED[*]}"
  exit 1
fi
echo "ALL PASS"
