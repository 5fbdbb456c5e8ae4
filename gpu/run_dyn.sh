#!/bin/bash
# dyn-disable proof on the H200 machine. Run from the repo root with the carried
# folders .whl1 .whl2 .whl3 (see gpu/README.md; SGLANG_RELEASE=0.5.17: .whl1-0.5.17 .whl2 .whl3-0.5.17). Usage:
#   bash gpu/run_dyn.sh PHASE [PHASE ...]      PHASE: small | big (see gpu/dyn_device.py)
#   bash gpu/run_dyn.sh setup                  only prepare /tmp/site and /tmp/models
# Env: BUDGET_S (default 540): the driver skips work that would end past it.
#      DYN_APPLY=0: leave /tmp/site pristine (e.g. to apply patchsets with the toolkit instead).
#      DYN_PATCHSETS (default "dyn-disable"): patchsets applied in order, e.g. "sm120 dyn-disable".
#      HUGE=1: also write the config-only 32B-shape pair (make_models.py --huge).
#      KIMI_LAYERS=N: also write the config-only Kimi-K2.5-shape pair (make_models.py --kimi N).
#      KIMI_DEEP_LAYERS=N: also write the deeper one (make_models.py --kimi-deep N, pair "kimideep").
#      TINY_MLA=1: also write the small DeepseekV3 (MLA + MoE) pair (make_models.py --tiny-mla).
#      BIG_LAYERS (default 16): layers of the config-only dummy target (see make_models.py).
#      FI_COMM_PREWARM=1: build FlashInfer's trtllm all-reduce fusion kernel in the background.
#      SIM_ACCEPT (per-step | per-request, default per-step): how SGLANG_SIMULATE_ACC_LEN draws
#        (gpu/sim_accept.py: SGLang's one length per step, or one per request; 0.5.11 only).
#      OUT: results folder (set by the GPU machine).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/dyn-logs
mkdir -p "$OUT" "$LOGS"
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
finish() { tar -C "$LOGS" -czf "$OUT/logs.tgz" . 2>/dev/null; say "done"; }
trap finish EXIT

. gpu/device_env.sh
# the drivers launch servers through toolkit.server.profiles (gpu/lab_launch.py), which imports unidiff
ls .whl2/unidiff-*.whl >/dev/null 2>&1 || python3 -c "import unidiff" 2>/dev/null || {
  say ".whl2 lacks the unidiff wheel: python3 -m pip download --no-deps -d .whl2 unidiff==1.0.1 (dev machine)"; exit 1; }
if [ -d /tmp/site/sglang ] && [ ! -d /tmp/site/sglang-$SGLANG_RELEASE.dist-info ]; then
  say "/tmp/site holds another sglang than SGLANG_RELEASE=$SGLANG_RELEASE: rm -rf /tmp/site /tmp/stock /tmp/naive /tmp/fi_ready first"; exit 1
fi
if [ ! -d /tmp/site/sglang ]; then
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl1$SFX/site.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl 2>&1 | grep -v WARNING
  for t in .whl3$SFX/*.tar.xz; do tar -C /tmp/site -xJf "$t"; done
  rm -rf /tmp/site/typing_extensions.py /tmp/site/typing_extensions-*.dist-info
  if [ -n "$SFX" ] && ! python3 -c "import deep_gemm" 2>/dev/null; then
    # 0.5.17's v2 EAGLE worker imports the DSA attention backend while it captures its draft
    # graphs, and that module imports deep_gemm (sgl-deep-gemm, not carried: its JIT headers are
    # 28 MB) at module level; nothing calls into it on the triton path. An empty package stands
    # in, and SGLANG_ENABLE_JIT_DEEPGEMM=0 (device_env.sh) keeps sglang from taking it for the
    # real one (DeepGEMM serves only fp8 GEMMs, which these bf16 models do not run).
    mkdir -p /tmp/site/_stubs/deep_gemm
    printf '"""Stand-in for sgl-deep-gemm (gpu/run_dyn.sh): importable, with nothing in it."""\n' \
      > /tmp/site/_stubs/deep_gemm/__init__.py
  fi
  if [ "$SGLANG_RELEASE" = 0.5.23 ] && ! python3 -c "import cutlass" 2>/dev/null; then
    # 0.5.23's models import CuTe DSL kernel modules while they are built (nvidia-cutlass-dsl, 193 MB
    # of compiler library, not carried; these kernels are SM100-only and never run on an H200). Each
    # module listed in stand_ins/cutlass_scoped_modules.txt runs under stand_ins/cutlass_scoped.py,
    # which lends it the cutlass stand-in only while it imports: on the whole path the stand-in makes
    # FlashInfer build its own CuTe DSL kernels and `import flashinfer` fails.
    bash gpu/stand_ins/scope_cutlass.sh /tmp/site || { say "scoping the cutlass stand-in failed"; exit 1; }
  fi
  if [ "$SGLANG_RELEASE" = 0.5.23 ] && ! python3 -c "import flash_mla" 2>/dev/null; then
    # 0.5.23's v2 EAGLE worker imports the FlashMLA backend while it captures its draft graphs, only
    # to ask whether the draft's backend is one (the fifth 0.5.23 call); FlashMLA (sgl-flash-mla) is
    # not carried, and the lab's backends are triton
    mkdir -p /tmp/site/_stubs && cp -r gpu/stand_ins/flash_mla /tmp/site/_stubs/
  fi
  # pristine copy (eagle3-stock) and the naive bypass copy, before patching /tmp/site
  mkdir -p /tmp/stock /tmp/naive
  cp -a /tmp/site/sglang /tmp/stock/ && cp -a /tmp/site/sglang /tmp/naive/
  # the naive bypass is written into the v1 EAGLE worker, which 0.5.23 no longer has
  if [ -f /tmp/naive/sglang/srt/speculative/eagle_worker.py ]; then
    python3 gpu/naive_bypass.py /tmp/naive/sglang
  else
    say "no v1 EAGLE worker in sglang $SGLANG_RELEASE: no naive-bypass copy"; rm -rf /tmp/naive
  fi
  if [ "${DYN_APPLY:-1}" = 1 ]; then
  # the diffs of the release installed in /tmp/site (patchsets/NAME/<release>/*.patch)
  REL=$(basename /tmp/site/sglang-*.dist-info .dist-info | sed 's/^sglang-//')
  for ps in ${DYN_PATCHSETS:-dyn-disable}; do
    ls patchsets/$ps/$REL/*.patch >/dev/null 2>&1 || { say "patchset $ps has no diffs for sglang $REL"; exit 1; }
    for p in patchsets/$ps/$REL/*.patch; do
      python3 gpu/apply_patch.py "$p" /tmp/site || { say "patch $p failed"; exit 1; }
    done
  done
  # every file the applied patches touch, read from their diff headers
  patched=$(for ps in ${DYN_PATCHSETS:-dyn-disable}; do sed -n 's#^+++ b/#/tmp/site/#p' patchsets/$ps/$REL/*.patch; done | sort -u)
  python3 -m py_compile $patched && say "patched files compile (${DYN_PATCHSETS:-dyn-disable}: $(echo $patched | wc -w) files)"
  fi
fi
set_sim_accept || { say "SIM_ACCEPT=${SIM_ACCEPT:-per-step} could not be set"; exit 1; }
export PYTHONPATH=/tmp/site
EXTRA=$STUBS
say "site ready (extra pythonpath: '$EXTRA')"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader

if [ ! -f /tmp/fi_ready ]; then
  PYTHONPATH=/tmp/site:$EXTRA python3 -c "
import torch, flashinfer.norm as n
x = torch.randn(4, 512, device='cuda', dtype=torch.bfloat16); w = torch.ones(512, device='cuda', dtype=torch.bfloat16)
n.rmsnorm(x, w); r = x.clone(); n.fused_add_rmsnorm(x, r, w); torch.cuda.synchronize(); print('flashinfer norm JIT ready')
" > $LOGS/fi_prewarm.log 2>&1 && touch /tmp/fi_ready &
PREWARM=$!
fi
models_missing() {  # the tiny pairs, or a pair asked for by HUGE / KIMI_LAYERS / TINY_MLA, not there yet
  [ ! -d /tmp/models/target-sharp ] || { [ "${HUGE:-}" = 1 ] && [ ! -d /tmp/models/target-huge ]; } \
    || { [ -n "${KIMI_LAYERS:-}" ] && [ ! -d /tmp/models/target-kimi ]; } \
    || { [ -n "${KIMI_DEEP_LAYERS:-}" ] && [ ! -d /tmp/models/target-kimideep ]; } \
    || { [ "${TINY_MLA:-}" = 1 ] && [ ! -d /tmp/models/target-mlasharp ]; }
}
if [ "${FI_COMM_PREWARM:-}" = 1 ] && [ ! -f /tmp/fi_comm_ready ]; then
  # FlashInfer's trtllm all-reduce fusion kernel takes ~2 min of nvcc on its first use: built in
  # the background here, so a later server that turns the fusion on finds it in the JIT cache
  # (all of its output to a file: a pipe reading this script's output must not wait for it)
  ( PYTHONPATH=/tmp/site:$EXTRA python3 -c "from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g(); print('trtllm comm JIT ready')" \
      && touch /tmp/fi_comm_ready ) > /tmp/fi_comm_prewarm.log 2>&1 < /dev/null &
fi
if models_missing; then
  PYTHONPATH=/tmp/site:$EXTRA python3 gpu/make_models.py /tmp/models --corpus /tmp/site/sglang/srt --big ${BIG_LAYERS:-16} \
    $([ "${HUGE:-}" = 1 ] && echo --huge) $([ -n "${KIMI_LAYERS:-}" ] && echo --kimi $KIMI_LAYERS) \
    $([ -n "${KIMI_DEEP_LAYERS:-}" ] && echo --kimi-deep $KIMI_DEEP_LAYERS) \
    $([ "${TINY_MLA:-}" = 1 ] && echo --tiny-mla) 2>&1 | tail -1
fi
[ -n "${PREWARM:-}" ] && wait $PREWARM
say "$(tail -n 1 $LOGS/fi_prewarm.log 2>/dev/null)"
[ "${1:-}" = setup ] && { say "setup only: PYTHONPATH=/tmp/site${EXTRA:+:$EXTRA}, models in /tmp/models"; exit 0; }
PYTHONPATH=/tmp/site:$EXTRA python3 gpu/dyn_device.py "$@" --out "$OUT" --budget-s $(( BUDGET_S - ( $(date +%s) - T0 ) )) 2>&1 | tee "$OUT/driver.log"
