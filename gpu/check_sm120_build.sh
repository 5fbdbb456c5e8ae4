#!/bin/bash
# Can the pinned FlashInfer (0.6.8.post1; FLASHINFER_VERSION=0.7.2 for the gpu-0.5.23 stack) give an
# SM120 host its TRT-LLM all-reduce fusion?
# Needs no GPU: it installs the pinned CUDA 13.0 compiler wheels, the pinned flashinfer-python
# (for its JIT sources in flashinfer/data/) and the headers FlashInfer's JIT compiles against
# (CCCL 13.0, apache-tvm-ffi) into a private venv, then
#   1. runs FlashInfer's own JIT arch selection (flashinfer/compilation_context.py, as an SM 12.0
#      box would: FLASHINFER_CUDA_ARCH_LIST=12.0f) for the trtllm_comm module
#      (flashinfer/jit/comm.py: gen_trtllm_comm_module, supported_major_versions),
#   2. compiles the module's three sources with that nvcc, with FlashInfer's JIT flags, for
#      sm_90a (what FlashInfer builds on an H200: the control) and sm_120a / sm_120f (SM120),
#   3. compares every kernel's ptxas register use between sm_90a and SM120: a kernel whose body
#      an `#if __CUDA_ARCH__ < 1200` removed shows up with almost no registers on SM120.
# Prints what compiled and what did not (with nvcc's errors) and writes report.md + report.json.
#
#   bash gpu/check_sm120_build.sh [OUT_DIR]          # default OUT_DIR: .cache/sm120-build/out
# Env: ARCHS (default "sm_90a sm_120a sm_120f"), SOURCES (default: the three trtllm_comm files),
#      NVCC_THREADS (default 2), FLASHINFER_VERSION (default 0.6.8.post1). About 2 minutes per file
#      and arch on 2 cores.
set -eu
cd "$(dirname "$0")/.."
CACHE=${TOOLKIT_CACHE:-$PWD/.cache}/sm120-build
OUT=${1:-$CACHE/out}
VENV=$CACHE/venv
PINS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
      nvidia-cuda-cccl==13.0.85 apache-tvm-ffi==0.1.15.post2"
mkdir -p "$CACHE" "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q $PINS 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/pip" install -q --no-deps "flashinfer-python==${FLASHINFER_VERSION:-0.6.8.post1}" 2>&1 | grep -v "^WARNING: Location" || true
exec "$VENV/bin/python" gpu/check_sm120_build.py --out "$OUT" --archs "${ARCHS:-sm_90a sm_120a sm_120f}" \
  --threads "${NVCC_THREADS:-2}" ${SOURCES:+--sources "$SOURCES"}
