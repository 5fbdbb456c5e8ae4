#!/bin/bash
# dyn-disable on the reference shapes (gpu/shapes_device.py) on the H200 machines. Run from the
# repo root with .whl1 .whl2 .whl3 carried (gpu/README.md):
#   BUDGET_S=540 bash gpu/run_shapes.sh gpu/plans/PLAN.json 2>&1 | tee $OUT/run.log
# Makes the site (dyn-disable applied), the tiny, Kimi-shape (KIMI_LAYERS, default 6) and small
# MLA models, prewarms FlashInfer when a plan uses it, runs the plan, and packs the server logs and
# results into $OUT/evidence.tgz, torch traces into $OUT/traces.tar.part-NN (results JSON and
# records.jsonl also land in $OUT directly).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/out}
PLAN=$1
# a plan whose servers do not fit the GPU memory is refused before the setup spends device time
# (gpu/plan_memory.py; SKIP_MEMORY_CHECK=1 starts it anyway; shapes_device.py checks again)
KIMI_LAYERS=${KIMI_LAYERS:-6} python3 gpu/plan_memory.py --check "$PLAN" || exit 3
mkdir -p "$OUT"
# a machine still warm from an earlier call keeps its /tmp: pack only this call's logs
rm -rf /tmp/dyn-logs && mkdir -p /tmp/dyn-logs
# a file over 16 MiB does not come back from the device (the 2026-12-02 prefill traces were 18 MB):
# the logs go alone into evidence.tgz, the torch traces into 15 MiB parts
# (cat traces.tar.part-* | tar x; the traces are gzipped already)
pack() {
  tar -C /tmp/dyn-logs --exclude=./traces -czf "$OUT/evidence.tgz" . 2>/dev/null
  if [ -d /tmp/dyn-logs/traces ]; then
    tar -C /tmp/dyn-logs -cf - traces | split -b 15m -d - "$OUT/traces.tar.part-"
  fi
  echo "[t=$(( $(date +%s) - T0 ))s] packed"
}
trap pack EXIT
KIMI_LAYERS=${KIMI_LAYERS:-6} TINY_MLA=1 OUT=/tmp/dyn-setup bash gpu/run_dyn.sh setup 2>&1 | tail -n 5
# a failed setup (e.g. a warm machine's /tmp/site of another release) would start every server on
# the wrong site and wait for them to die: stop here (the 2026-12-03 eleventh session lost a call so)
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[t=$(( $(date +%s) - T0 ))s] setup failed: nothing started"; exit 4; }
. gpu/device_env.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=/tmp/site${STUBS:+:$STUBS} python3 gpu/shapes_device.py "$PLAN" --out "$OUT" \
  --budget-s $(( BUDGET_S - ( $(date +%s) - T0 ) ))
