#!/bin/bash
# The first-crossing stall (issue #25 part 1) on a Kimi-shape target at TP=1, before and after the
# fix, and the smoke's stall check on both: gpu/firstcross_device.py in ONE device call.
# Run from the repo root with the carried .whl1 .whl2 .whl3, after `bash gpu/run_dyn.sh setup`
# (run_accept.sh does it; without /tmp/site this script runs it first):
#   BUDGET_S=200 bash gpu/run_firstcross.sh 2>&1 | tee $OUT/firstcross.log
# Env: BUDGET_S (default 200): everything ends inside it (the driver gets what is left).
#      KIMI_LAYERS (default 6), KIMI_EXPERTS (default 8): the Kimi-shape pair made when
#        /tmp/models has none this small (written to /tmp/models-fc then).
#      DYN_THRESHOLD (default 12), CROSSINGS (default 10), FC_SERVERS (default all five),
#      FC_MEM (default 0.8: --mem-fraction-static of each server).
#      FC_OLD (default gpu/fixtures/dyn-disable-before-fix): the folder of the old patch stack,
#        its *.patch files applied in name order; its name is the old servers' patch name.
#      FC_PROFILE (default eagle3-v2-dyn): the old and new servers' profile.
#      FC_NEW (default after-fix): the name the new servers' records carry (the checkout's patchset).
# Builds /tmp/site-r8: the pristine sglang (/tmp/stock) with the old patch stack (by default the
# dyn-disable patch as it stood before the first-crossing fix), for the "old-*" servers.
# $OUT gets firstcross.json and firstcross.tgz (server logs, records.jsonl, driver log, logs scan).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-200}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/dyn-logs
WORK=$LOGS/firstcross
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ( $(date +%s) - T0 ) )); }
finish() {
  [ -f "$WORK/firstcross.json" ] && cp "$WORK/firstcross.json" "$OUT/"
  # this run's server logs only (the accept run's are in its own evidence.tgz)
  tar -C "$LOGS" -czf "$OUT/firstcross.tgz" firstcross $(cd "$LOGS" && ls fc-*.log 2>/dev/null) 2>/dev/null
  say "done"
}
trap finish EXIT

if [ ! -d /tmp/site/sglang ] || [ ! -d /tmp/stock/sglang ]; then
  OUT=/tmp/setup-out bash gpu/run_dyn.sh setup || { say "setup failed"; exit 1; }
fi
. gpu/device_env.sh
export PYTHONPATH=/tmp/site${STUBS:+:$STUBS}

# the old patch stack, on a fresh copy of the pristine sglang
rm -rf /tmp/site-r8 && mkdir -p /tmp/site-r8 && cp -a /tmp/stock/sglang /tmp/site-r8/
FC_OLD=${FC_OLD:-gpu/fixtures/dyn-disable-before-fix}
for FIX in $(ls "$FC_OLD"/*.patch | sort); do
  python3 gpu/apply_patch.py $FIX /tmp/site-r8 >> "$WORK/apply_old.log" || { cat "$WORK/apply_old.log"; say "old patch $FIX failed"; exit 1; }
done
python3 -m py_compile $(cat "$FC_OLD"/*.patch | sed -n 's#^+++ b/#/tmp/site-r8/#p' | sort -u) && say "/tmp/site-r8: $FC_OLD applied"

# a Kimi-shape pair small enough for five servers on one H200
MODELS=/tmp/models
experts() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['n_routed_experts'])" "$1/target-kimi/config.json" 2>/dev/null || echo 999; }
if [ "$(experts $MODELS)" -gt "${KIMI_EXPERTS:-8}" ]; then
  MODELS=/tmp/models-fc
  if [ "$(experts $MODELS)" -gt "${KIMI_EXPERTS:-8}" ]; then
    KIMI_EXPERTS=${KIMI_EXPERTS:-8} python3 gpu/make_models.py $MODELS --corpus /tmp/site/sglang/srt --no-weights \
      --kimi ${KIMI_LAYERS:-6} 2>&1 | tail -1
  fi
fi
[ -f $MODELS/target-kimi/config.json ] || { say "no kimi pair in $MODELS"; exit 1; }
say "models: $MODELS (kimi: $(experts $MODELS) routed experts)"

# every server's own JIT caches, empty (gpu/firstcross_device.py says why)
rm -rf /tmp/fc-jit
python3 gpu/firstcross_device.py --out "$WORK" --budget-s $(( $(left) - 10 )) --models $MODELS \
  --threshold ${DYN_THRESHOLD:-12} --crossings ${CROSSINGS:-10} --mem ${FC_MEM:-0.8} \
  --dyn-profile ${FC_PROFILE:-eagle3-v2-dyn} --old-patch "$(basename "$FC_OLD")" --new-patch "${FC_NEW:-after-fix}" \
  ${FC_SERVERS:+--servers $FC_SERVERS} 2>&1 | tee "$WORK/driver.log"
