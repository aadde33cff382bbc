#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: `fsdpturbo plan`, a dry run of
# a 32-rank Qwen3-30B-A3B EP launch (pass your own arguments to plan something else, e.g.
# scripts/demo.sh --config examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml
#                 --model examples/models/qwen3_5_35b_a3b.json --world-size 16 --rank 3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec target/release/fsdpturbo plan "$@"
