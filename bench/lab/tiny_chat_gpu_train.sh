#!/usr/bin/env bash
# tiny-chat's two training phases on the device machine (engine/train/train_tiny_chat.py, the
# same script and seeds as on the CPU, deterministic XLA GPU ops), then engine.train.evaluate on
# the result. Outputs under $OUT: the phase logs, the shipped-format file split in 15 MB parts,
# eval.json, probe.log (the qualification's own retrieval prompt by length,
# bench/lab/retrieval_by_length.py --artifact). Usage (device tool):
#   bash bench/lab/tiny_chat_gpu_train.sh STEPS2 MINUTES2 [PHASE2 [EVAL]]
# PHASE2: the second run's data mix (engine/train/batches.py PARTS; default 2); EVAL 0
# stops after the weights (the device call's time goes to training; evaluate on the CPU); EVAL
# probe runs only the OMP screen: with PROBE=FILE (a capture of bench/lab/omp_tool_prompt.py),
# the candidate on OMP's tool-turn prompt.
# INIT=FILE (a carried file of an earlier run's --out) continues from it without phase 0;
# LR sets the second run's peak learning rate (default 2e-3); CLIENT="FILE..." passes each
# file as --client (phase 9: captures of bench/lab/omp_tool_prompt.py); PROBE may name several
# captures (space-separated), each probed in turn.
set -u
steps2=${1:-1200}; minutes2=${2:-5.5}; phase2=${3:-2}; run_eval=${4:-1}
export XLA_FLAGS=--xla_gpu_deterministic_ops=true PYTHONUNBUFFERED=1
py=python3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
init=${INIT:-}; lr=${LR:-2e-3}
if [ -z "$init" ]; then
  $py -m engine.train.train_tiny_chat --phase 0 --steps 500 --lr 3e-3 --out /tmp/P0.safetensors \
    --raw /tmp/P0.npz --log "$OUT/P0.json" > "$OUT/P0.log" 2>&1 || { tail -20 "$OUT/P0.log"; exit 3; }
  tail -1 "$OUT/P0.log" | cut -c1-200
  init=/tmp/P0.npz
fi
clients=(); for c in ${CLIENT:-}; do clients+=(--client "$c"); done
$py -m engine.train.train_tiny_chat --init "$init" --phase "$phase2" --steps "$steps2" --lr "$lr" \
  --minutes "$minutes2" "${clients[@]}" --out /tmp/P2.safetensors --log "$OUT/P2.json" > "$OUT/P2.log" 2>&1 \
  || { tail -20 "$OUT/P2.log"; exit 4; }
tail -2 "$OUT/P2.log" | cut -c1-400
split -b 15M -d /tmp/P2.safetensors "$OUT/P2.part"
sha256sum /tmp/P2.safetensors | tee "$OUT/P2.sha256"
[ "$run_eval" = 0 ] && exit 0
# the evaluation: the candidate pinned in this copy of the tree, its artifact built, evaluated
cp /tmp/P2.safetensors engine/io/weights/tiny_chat.safetensors
sed -i "s/^WEIGHTS_SHA256 = \"[0-9a-f]*\"/WEIGHTS_SHA256 = \"$(cut -d' ' -f1 "$OUT/P2.sha256")\"/" \
  engine/io/tiny_chat.py
$py -c "from pathlib import Path; from engine.io.loader import build_embedded; \
print(build_embedded('tiny-chat', Path('/tmp/tc.ninfer')))" || exit 5
for p in ${PROBE:-}; do
  timeout 100 $py bench/lab/omp_tool_prompt.py probe "$p" --artifact /tmp/tc.ninfer \
    2>&1 | tail -1 | tee -a "$OUT/omp_probe.json"
done
[ "$run_eval" = probe ] && exit 0
timeout 150 $py -m engine.train.evaluate --artifact /tmp/tc.ninfer --n 10 --n-long 2 \
  --out "$OUT/eval.json" > /dev/null 2>&1; echo "eval rc=$?"
timeout 200 $py bench/lab/retrieval_by_length.py --artifact /tmp/tc.ninfer > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; cat "$OUT/probe.log" | tail -9
