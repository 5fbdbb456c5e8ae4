#!/bin/bash
# threshold=auto against the best fixed threshold of a sweep (issue #29), one workload per call:
# site setup (unless SKIP_SETUP=1), the trained pair (unless it is already in /tmp/models), then
# gpu/auto_device.py with what is left. First run on 2026-12-02 (docs/evidence/auto-threshold/1-first-gpu-run).
# Run from the repo root with the carried .whl1 .whl2 .whl3 (gpu/README.md):
#   WORKLOAD=own BUDGET_S=570 bash gpu/run_auto.sh 2>&1 | tee $OUT/run.log
#   SKIP_SETUP=1 WORKLOAD=random BUDGET_S=570 bash gpu/run_auto.sh 2>&1 | tee $OUT/run.log
# A pair whose steps are GPU work, with two simulated acceptances as the two workloads (the issue's
# other option; on the trained pair every step is host work, docs/evidence/auto-threshold/3-interleaved):
#   PAIR=big BIG_LAYERS=24 WORKLOAD=sim ACC_LEN=2.5 NAME=big24-acc2.5 BUDGET_S=540 \
#     AUTO_ARGS="--min-s 2.5 --mem 0.45 --kv-tokens 16384" bash gpu/run_auto.sh
# Env: WORKLOAD (own | random | sim, default own), NAME (the workload's name in the records and
#      part-NAME.json, default WORKLOAD), PAIR (trained, default, or a config-only pair of
#      run_dyn.sh's setup, e.g. big with BIG_LAYERS, for WORKLOAD=sim: no training), ACC_LEN
#      (SGLANG_SIMULATE_ACC_LEN of a config-only pair, default 2.5), BUDGET_S (default 570), SKIP_SETUP=1 (/tmp/site is
#      there: a warm machine), TARGET_S / DRAFT_S (default 70 / 35: training on the GPU),
#      AUTO_FIXED (default 2,8,16,64), AUTO_LEVELS (default 1,4,16,32,64), AUTO_ROUNDS (3),
#      AUTO_ARGS (more driver flags, e.g. "--bursty-s 20 --period-s 4"), PAIR_ARCH (llama | mla),
#      SIM_ACCEPT (per-step | per-request: how the simulated acceptance draws, gpu/sim_accept.py;
#      --acc-mix in AUTO_ARGS needs per-request; set on every call, SKIP_SETUP=1 too).
# $OUT gets part-$NAME.json, records.jsonl, auto_state.jsonl (auto_variant_state.jsonl with --auto-variants), train_report.json (trained pair) and
# evidence.tgz (server logs, driver log, logs_scan.json, host_samples.jsonl: gpu/host_sampler.py).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
WORKLOAD=${WORKLOAD:-own}
NAME=${NAME:-$WORKLOAD}
PAIR=${PAIR:-trained}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/dyn-logs
WORK=$LOGS/auto-$NAME
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
MARK=$(mktemp /tmp/auto-call-start.XXXXXX)
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ( $(date +%s) - T0 ) )); }
# the GPU's clocks, temperature, power and memory in use at the start and end of a call, and any
# compute process alive at the start: two calls on one warm machine read 10,001 and 7,699 tok/s for
# the same server at the same load (docs/evidence/auto-threshold/23-big16-charge-check), and
# nothing recorded then could say whether the GPU or the servers had changed
gpu_state() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used,memory.total \
    --format=csv,noheader 2>&1 | sed "s/^/[gpu $1] /"
}
finish() {
  [ -n "${SAMPLER:-}" ] && kill "$SAMPLER" 2>/dev/null
  gpu_state end
  for f in part-$NAME.json records.jsonl auto_state.jsonl auto_variant_state.jsonl; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
  [ "$PAIR" = trained ] && [ -f /tmp/models/train_report.json ] && cp /tmp/models/train_report.json "$OUT/"
  # this call's servers and driver only: files written since it began (a machine can keep an
  # earlier call's logs and traces, even one of an earlier session)
  (cd "$LOGS" && find . -type f -newer "$MARK" ! -path './traces/*' -print0 \
    | tar --null -T - -czf "$OUT/evidence.tgz") 2>/dev/null
  say "done"
}
trap finish EXIT

. gpu/device_env.sh
gpu_state start
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 | sed "s/^/[gpu start] process: /"
if [ "${SKIP_SETUP:-0}" = 1 ] && [ -d /tmp/site ]; then
  say "setup skipped (SKIP_SETUP=1)"
  set_sim_accept || { say "SIM_ACCEPT=${SIM_ACCEPT:-per-step} could not be set"; exit 1; }
else
  OUT=/tmp/setup-out bash gpu/run_dyn.sh setup || { say "setup failed"; exit 1; }
fi
grep -q "dyn_disable_auto" /tmp/site/sglang/srt/managers/scheduler.py \
  || { say "the site lacks 0003-dyn-disable-auto.patch"; exit 1; }
export PYTHONPATH=/tmp/site${STUBS:+:$STUBS}
# PAIR_ARCH (make_trained_pair.sh): a pair of the other architecture is trained again
if [ "$PAIR" != trained ]; then
  [ -f /tmp/models/target-$PAIR/config.json ] || { say "no /tmp/models/target-$PAIR (run_dyn.sh setup writes it)"; exit 1; }
  say "config-only pair $PAIR (dummy weights, simulated accept length ${ACC_LEN:-2.5})"
elif [ -f /tmp/models/draft-trained/model.safetensors ] && [ -f /tmp/models/heldout.json ] && python3 -c \
    "import json, sys; sys.exit(json.load(open('/tmp/models/train_report.json')).get('arch', 'llama') != '${PAIR_ARCH:-llama}')"; then
  say "trained ${PAIR_ARCH:-llama} pair already in /tmp/models"
else
  say "training the pair ($(left) s left)"
  # training keeps 240 s of the budget for the servers; the pair needs TARGET_S 70 s +
  # DRAFT_S 35 s + data and loading (about 190 s in the twenty-sixth session), so BUDGET_S under about
  # 460 on a fresh machine leaves no trained pair
  bash gpu/make_trained_pair.sh $(( $(left) - 240 )) "$WORK" || { say "no trained pair"; exit 1; }
fi
say "pair ready ($(left) s left); workload $WORKLOAD ($NAME)"
# the host's and the GPU's state twice a second while the servers run, for
# `gpu/host_check.py` (in evidence.tgz: auto-$NAME/host_samples.jsonl)
python3 gpu/host_sampler.py "$WORK/host_samples.jsonl" --gpu --max-s "$(left)" &
SAMPLER=$!
python3 gpu/auto_device.py --out "$WORK" --workload "$WORKLOAD" --name "$NAME" --pair "$PAIR" \
  --acc-len "${ACC_LEN:-2.5}" --budget-s $(( $(left) - 15 )) \
  --fixed ${AUTO_FIXED:-2,8,16,64} --levels ${AUTO_LEVELS:-1,4,16,32,64} --rounds ${AUTO_ROUNDS:-3} \
  ${AUTO_ARGS:-} 2>&1 | tee "$WORK/driver.log"
