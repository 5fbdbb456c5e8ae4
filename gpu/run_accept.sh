#!/bin/bash
# Real acceptance across dyn-disable's crossings (issue #24) and the first-crossing stall (issue
# #25 part 1), in ONE device call: site setup, the trained pair, seven servers, the protocol.
# Run from the repo root with the carried .whl1 .whl2 .whl3 (gpu/README.md):
#   BUDGET_S=330 bash gpu/run_accept.sh 2>&1 | tee $OUT/run.log
# Env: BUDGET_S (default 330): everything ends inside it (the driver gets what is left), so a
#        second script fits in the same 600 s call.
#      SKIP_SETUP=1: /tmp/site etc. are there already (`bash gpu/run_dyn.sh setup` ran before).
#      TARGET_S / DRAFT_S (default 70 / 35): training time of the target / the draft on the GPU.
#      PAIR_ARCH (default llama): mla trains a small DeepseekV3 (MLA + MoE) target instead, under
#        the same name (/tmp/models/*-trained); the servers run it with --attention-backend triton
#        like every lab server (shapes_device.Server's default), as the tinymla/mlasharp pairs ran.
#      DYN_THRESHOLD (default 8), CROSSINGS (default 10), ACCEPT_SERVERS (default: the seven above;
#        the native plain path's acceptance after a resume, writing and skipping the draft's KV:
#        ACCEPT_SERVERS=baseline,eagle3-v2,eagle3-v2-dyn-native,eagle3-v2-dyn-native-skip),
#      SPAN_TOKENS / BURST_TOKENS (default 384 / 128), CONTROL_N (default 64: burst prompts the
#      baseline runs again at c=1 and in the burst shape).
#      LATE_SPANS (default 0): spanning requests per crossing that arrive once the burst holds
#        drafting off (prefilled while plain: what SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer leaves
#        without the draft's prefill); summary.json's late_tail_over_stock; at most
#        threshold - hysteresis - 4 (the driver says so). For defer against skip:
#        LATE_SPANS=2 ACCEPT_SERVERS=baseline,eagle3-v2,eagle3-v2-dyn-native-skip,eagle3-v2-dyn-native-defer
#      PROFILE_RESUME (a dyn server's label, e.g. eagle3-v2-dyn-native-skip): a torch profile across
#        crossings 1's and 2's resumes on it (traces in evidence.tgz under traces/; that server's
#        stall figures are then taken with the profiler on); PROFILE_CROSSINGS (default 1,2) picks
#        the crossings, e.g. PROFILE_CROSSINGS=3,4,5 for the long later resumes.
#      C1_ROUNDS / C1_PROMPTS / C1_TOKENS (default 8 / 1 / 192): the c=1 measure of the goal
#        (after the bursts >= 0.98x before): A/B rounds before and after the crossings in which each
#        dyn server, its stock peer and its negative control decode the same prompts one at a time
#        in mirrored order; summary.json's c1_after_over_before = median dyn/stock after over before
#        (~67 s of the budget). The raw one-server c1_raw_tok_s_* moved +-20-40 % on stock servers.
# $OUT gets summary.json, first_crossing.json, train_report.json and evidence.tgz (server logs,
# records.jsonl, accept_raw.json, logs_scan.json, train.log); only a few files come back.
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-330}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/dyn-logs
WORK=$LOGS/accept
mkdir -p "$OUT" "$WORK"
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ( $(date +%s) - T0 ) )); }
finish() {
  for f in summary.json first_crossing.json; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
  [ -f /tmp/models/train_report.json ] && cp /tmp/models/train_report.json "$OUT/" && cp /tmp/models/train_report.json "$WORK/"
  tar -C "$LOGS" -czf "$OUT/evidence.tgz" . 2>/dev/null
  say "done"
}
trap finish EXIT

# /tmp/site (dyn-disable applied), /tmp/stock, the FlashInfer norm JIT, make_models' pairs
if [ "${SKIP_SETUP:-0}" = 1 ]; then
  [ -d /tmp/site ] || { say "SKIP_SETUP=1 but no /tmp/site: run gpu/run_dyn.sh setup first"; exit 1; }
  say "setup skipped (SKIP_SETUP=1)"
else
  OUT=/tmp/setup-out bash gpu/run_dyn.sh setup || { say "setup failed"; exit 1; }
fi
. gpu/device_env.sh
export PYTHONPATH=/tmp/site${STUBS:+:$STUBS}
say "training the ${PAIR_ARCH:-llama} pair ($(left) s left)"
bash gpu/make_trained_pair.sh $(( $(left) - 120 )) "$WORK" || { say "no trained pair"; exit 1; }
say "pair trained ($(left) s left)"
python3 gpu/accept_device.py --out "$WORK" --budget-s $(( $(left) - 15 )) \
  --threshold ${DYN_THRESHOLD:-8} --crossings ${CROSSINGS:-10} --span-tokens ${SPAN_TOKENS:-384} \
  --burst-tokens ${BURST_TOKENS:-128} --control-n ${CONTROL_N:-64} --late-spans ${LATE_SPANS:-0} \
  --c1-rounds ${C1_ROUNDS:-8} --c1-prompts ${C1_PROMPTS:-1} --c1-tokens ${C1_TOKENS:-192} \
  ${ACCEPT_SERVERS:+--servers $ACCEPT_SERVERS} ${PROFILE_RESUME:+--profile-resume $PROFILE_RESUME} \
  ${PROFILE_CROSSINGS:+--profile-crossings $PROFILE_CROSSINGS} \
  2>&1 | tee "$WORK/driver.log"
