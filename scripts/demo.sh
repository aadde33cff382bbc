#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: examples/train.py on CPU gloo
# ranks through torchrun — a randomly initialised Qwen3-MoE trained with EP × EFSDP × outer FSDP2,
# checked against the same steps in one process, then a table of dispatchers. Arguments go to
# train.py (see `scripts/demo.sh --help`); NPROC sets the number of ranks (default 4), e.g.
#   NPROC=8 scripts/demo.sh --ep 4 --efsdp 2 --dispatcher fused --model qwen3_5_moe --steps 10
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh  # [setup] lines say what it is doing; the first run takes several minutes
export FSDPTURBO_LIB="$PWD/target/release/libfsdpturbo.so"
export FSDPTURBO_TORCH_LIB="$PWD/build/torch_ext/libfsdpturbo_torch.so"
export PYTHONPATH="$PWD/torch_ext/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
case " $* " in
  *" -h "* | *" --help "*) exec .venv/bin/python examples/train.py --help ;;
esac
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-4}" examples/train.py "$@"
