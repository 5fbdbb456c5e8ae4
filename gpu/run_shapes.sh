#!/bin/bash
# dyn-disable on the reference shapes (gpu/shapes_device.py) on the H200 machines. Run from the
# repo root with .whl1 .whl2 .whl3 carried (gpu/README.md):
#   BUDGET_S=540 bash gpu/run_shapes.sh gpu/plans/PLAN.json 2>&1 | tee $OUT/run.log
# Makes the site (dyn-disable applied), the tiny, Kimi-shape (KIMI_LAYERS, default 6) and small
# MLA models, prewarms FlashInfer when a plan uses it, runs the plan, and packs the server logs and
# results into $OUT/evidence.tgz (results JSON and records.jsonl also land in $OUT directly).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/out}
PLAN=$1
mkdir -p "$OUT"
pack() { tar -C /tmp/dyn-logs -czf "$OUT/evidence.tgz" . 2>/dev/null; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
trap pack EXIT
KIMI_LAYERS=${KIMI_LAYERS:-6} TINY_MLA=1 OUT=/tmp/dyn-setup bash gpu/run_dyn.sh setup 2>&1 | tail -n 5
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
EXTRA=""; python3 -c "import IPython.display" 2>/dev/null || EXTRA=/tmp/site/_stubs
export EXTRA_PYTHONPATH=$EXTRA
ldconfig -p | grep -q 'libnuma.so.1 ' || export LD_LIBRARY_PATH=$PWD/.whl1/libnuma:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=/tmp/site${EXTRA:+:$EXTRA} python3 gpu/shapes_device.py "$PLAN" --out "$OUT" \
  --budget-s $(( BUDGET_S - ( $(date +%s) - T0 ) ))
