#!/usr/bin/env bash
# The H200 issue's runs, one device call each (carry .whl; results under $OUT):
#
#   bash bench/h200_runs.sh 0     # the GPU suite: pytest -m gpu, all of it
#   bash bench/h200_runs.sh 1     # plans: ./ninfer bench h200 (C1/C2 1K/32K/128K, prefill
#                                 # 8K/32K/128K through the engine, 5 reps, the copy roofline,
#                                 # and the transformers + flash-linear-attention peer after it)
#   bash bench/h200_runs.sh 2     # lane and planner: serve --lane h200 --synthetic-weights
#                                 # through the preflight; planned vs measured device memory
#   bash bench/h200_runs.sh 3     # speculative verify cost against K (1,2,4,8) and the decode
#                                 # rate at acceptance 1 / 0.9 / 0.7 / 0.5, 27B shapes at 1K
#   bash bench/h200_runs.sh 4     # restore and restart, cold disk and page cache, 128K
#   bash bench/h200_runs.sh 5     # keep-warm: TTFT after 10/30/60 s idle, on and off
#   bash bench/h200_runs.sh 7     # the lane's receipt: qualify --lane h200 --synthetic-weights
#                                 # (the preflight refuses a disk with less free space than the
#                                 # profile's checkpoint quota; TMPDIR picks where the lane root goes)
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  | tee "$OUT/gpu.txt"
git log -1 --format=%H >> "$OUT/gpu.txt" 2>/dev/null
case "${1:-}" in
  # tests/conftest.py defaults JAX to the CPU; modules without a gpu test that import what the
  # GPU image lacks (openai, jsonschema, cyclonedx) fail to collect and are passed over
  0) JAX_PLATFORMS=cuda,cpu timeout 560 python3 -m pytest -m gpu -v -p no:cacheprovider \
       --continue-on-collection-errors --durations=15 2>&1 \
       | tee "$OUT/gpu_tests.log" ;;
  1) timeout 575 python3 bench/suites.py h200 --out "$OUT/bench_h200.json" 2>&1 \
       | tee "$OUT/bench_h200.log" ;;
  2) timeout 570 python3 bench/lane_server.py memory --lane h200 --tokens 8192 \
       --out "$OUT/lane_memory.json" 2>&1 | tee "$OUT/lane_memory.log" ;;
  3) timeout 570 python3 bench/spec_verify.py --k 1,2,4,8 --out "$OUT/spec_verify.json" 2>&1 \
       | tee "$OUT/spec_verify.log" ;;
  4) timeout 570 python3 bench/restore_27b.py --work-dir /tmp/r27 --budget-s 540 \
       --out "$OUT/restore_27b.json" 2>&1 | tee "$OUT/restore_27b.log" ;;
  5) timeout 570 python3 bench/lane_server.py keepwarm --lane h200 --idle 10,30,60 \
       --out "$OUT/keep_warm.json" 2>&1 | tee "$OUT/keep_warm.log" ;;
  7) timeout 580 python3 -m server.cli qualify --lane h200 --synthetic-weights --out "$OUT" 2>&1 \
       | tee "$OUT/qualify_h200.log" ;;
  *) echo "usage: bash bench/h200_runs.sh 0|1|2|3|4|5|7" >&2; exit 2 ;;
esac
