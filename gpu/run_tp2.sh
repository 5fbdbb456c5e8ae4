#!/bin/bash
# Issue "multi-GPU check" (TP=2 on two H200s, kind nvidia-h200-x2): the same toolkit-driven run as
# run_toolkit.sh with --tp-size 2 on every profile. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set for every server by run_toolkit.sh).
# What it shows: both ranks log the dyn-disable line and readiness waits for TP0 and TP1
# (server start eagle3-dyn); smoke's burst crosses the threshold; --enable-torch-symm-mem with sm120
# applied starts and serves; a baseline / eagle3 / eagle3-dyn sweep at 1, 8, 32.
# Not covered here: 50 threshold crossings at TP=2 (gpu/dyn_device.py's burst driver runs TP=1 servers).
#   BUDGET_S=540 bash gpu/run_tp2.sh 2>&1 | tee $OUT/run.log     (carry .whl1 .whl2 .whl3 .tkwheels)
set -u
nvidia-smi -L
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "needs 2 GPUs"; exit 1; }
TP=2 PHASES="${PHASES:-facts lifecycle symm sweep}" SWEEP_PROFILES=${SWEEP_PROFILES:-baseline,eagle3,eagle3-dyn} \
  SWEEP_LEVELS=${SWEEP_LEVELS:-1,8,32} exec bash "$(dirname "$0")/run_toolkit.sh"
