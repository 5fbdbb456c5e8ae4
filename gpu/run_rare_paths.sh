#!/bin/bash
# dyn-disable's rare paths on the H200 machines (issue #33 items 2-4; gpu/rare_paths_device.py says
# what each check does and when it passes). Run from the repo root with .whl1 .whl2 .whl3 carried:
#   CHECKS=logit,memory BUDGET_S=540 bash gpu/run_rare_paths.sh 2>&1 | tee $OUT/run.log          # nvidia-h200
#   CHECKS=sampling GPUS=0,1 BUDGET_S=420 bash gpu/run_rare_paths.sh 2>&1 | tee $OUT/run.log       # nvidia-h200-x2
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# a machine still warm from an earlier call keeps its /tmp: pack only this call's logs
rm -rf /tmp/dyn-logs && mkdir -p /tmp/dyn-logs
pack() { tar -C /tmp/dyn-logs -czf "$OUT/evidence.tgz" . 2>/dev/null; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
trap pack EXIT
OUT=/tmp/dyn-setup bash gpu/run_dyn.sh setup 2>&1 | tail -n 5
. gpu/device_env.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=/tmp/site${STUBS:+:$STUBS} python3 gpu/rare_paths_device.py "${CHECKS:-logit,memory}" --out "$OUT" \
  --gpus "${GPUS:-0}" --budget-s $(( BUDGET_S - ( $(date +%s) - T0 ) ))
