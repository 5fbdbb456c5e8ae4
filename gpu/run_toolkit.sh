#!/bin/bash
# The toolkit itself on the H200 machine, in `--host local` mode: facts, provision --dry-run,
# patch apply/verify, server start (eagle3-dyn), smoke, bench, server stop (GPU memory back to
# idle), and a baseline vs eagle3-dyn sweep on a 32-layer dummy target through `invoke bench`.
# Run from the repo root on the device with .whl1 .whl2 .whl3 (gpu/README.md) and .tkwheels
# (the toolkit's own control-side wheels + the sglang wheel in cache/wheels) carried:
#   BUDGET_S=540 bash gpu/run_toolkit.sh 2>&1 | tee $OUT/run.log
# Phases are skipped, with a message, when the time budget would be overrun.
# Phase rollout (issue #27): PHASES=rollout BUDGET_S=560 bash gpu/run_toolkit.sh > $OUT/run.log 2>&1
# Env: PHASES (default "facts lifecycle sweep"), SWEEP_PROFILES (default eagle3-dyn,baseline),
#      SWEEP_LEVELS (default 1,8,32,64), BIG_LAYERS (default 32), TP (tensor-parallel size, default 1), BENCH_OUT (sweep results folder;
#      default inside the evidence archive; $OUT/bench keeps them even if the call is cut).
# psweep: PS_PROFILES (default baseline,eagle3-v2,eagle3-v2-dyn,eagle3,eagle3-dyn) or PS_SETS
#      ("a,b;c,d": sets one after another) with PS_KEEP (profiles kept up across sets), PS_PAIR
#      (model pair, default big; kimi needs KIMI_LAYERS), PS_FLAGS / PS_ENV (extra server flags and
#      env lines), PS_BENCH_PROFILES (default: all; "" = no sweep), PS_INPUT_LEN / PS_OUTPUT_LEN,
#      PS_LEVEL_S, PS_MEM, PS_KV_TOKENS, PS_STAGGER_S, PS_C1_ROUNDS / PS_C1_PROFILES / PS_C1_REQUESTS
#      (alternating c=1 runs), PROFILE_PROFILES ("" = none), PROFILE_LOAD_C.
# hsweep: HUGE=1 (makes the 32B-shape models at setup), HUGE_PROFILES, HUGE_LEVEL_S.
# REPEAT (default 1): invoke bench --repeat for psweep and hsweep (median per level).
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/out}
EV=/tmp/ev  # everything but run.log; packed into $OUT/evidence.tgz at the end (few files come back)
rm -rf "$EV"; mkdir -p "$OUT" "$EV"
pack() { for f in /tmp/site/.toolkit/server/*/server.log; do [ -f "$f" ] && cp "$f" "$EV/$(basename "$(dirname "$f")").server.log"; done
         tar -C "$EV" -czf "$OUT/evidence.tgz" .; }
trap pack EXIT
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ( $(date +%s) - T0 ) )); }

# 1. The trimmed SGLang site (unpatched: the toolkit applies the patchsets) and the models.
DYN_APPLY=0 BIG_LAYERS=${BIG_LAYERS:-32} HUGE=${HUGE:-} OUT=$EV bash gpu/run_dyn.sh setup 2>&1 | tail -n 4
. gpu/device_env.sh

# 2. The toolkit's control side: the image has rich, jinja2, httpx, aiohttp, matplotlib; the rest is carried.
toolkit_side /tmp/inv
FLAGS='"--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
  "--disable-piecewise-cuda-graph", "--random-seed", "0", "--max-running-requests", "64",
  "--cuda-graph-max-bs", "64", "--decode-log-interval", "200"'
host() {  # host NAME MODEL-PAIR MEM EXTRA-FLAGS EXTRA-ENV [EXTRA-HOST-LINES EXTRA-SERVER-LINES KV-TOKENS]
  cat <<EOF
[$1]
transport = "local"
python = "python3"
pythonpath = "/tmp/site"
gpus = ${TP:-1}
stack = "gpu"
labels = ["h200"]
${6:-}
[$1.server]
tp_size = ${TP:-1}
model = "/tmp/models/target-$2"
draft_model = "/tmp/models/draft-$2"
${7:-}
flags = [$FLAGS, "--mem-fraction-static", "$3", "--max-total-tokens", "${8:-65536}"$4]
[$1.server.env]
$(server_env_toml)
$5
EOF
}
{ host gpu sharp 0.3 "" ""; host gpu-big big 0.7 ', "--load-format", "dummy"' 'SGLANG_SIMULATE_ACC_LEN = "2.6"'
  host gpu-symm sharp 0.3 ', "--enable-torch-symm-mem"' ""
  host gpu-huge huge 0.85 ', "--load-format", "dummy"' 'SGLANG_SIMULATE_ACC_LEN = "2.6"'; } > /tmp/inv/gpu.toml
apply_dyn_stack() { tk patch apply dyn-disable --host gpu && tk patch verify --host gpu; }
snap() { nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits > "$EV/nvsmi-$1.query-gpu.csv";
         nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$EV/nvsmi-$1.compute-apps.csv"; }

PHASES=" ${PHASES:-facts lifecycle sweep} "
say "toolkit ready; phases:$PHASES"
if [[ $PHASES == *" facts "* ]]; then
tk facts --host gpu
tk facts --host gpu --json > "$EV/facts.json"
tk provision --host gpu --stack gpu --dry-run
fi
snap idle

if [[ $PHASES == *" lifecycle "* ]]; then
# 3. Patch, serve, smoke, bench, stop: the user's commands.
tk patch apply dyn-disable --host gpu && tk patch verify --host gpu
tk server start eagle3-dyn --host gpu --timeout 300 && {
  snap serving
  tk server status --host gpu
  tk smoke --host gpu
  tk bench --host gpu --no-restart --concurrency 1,8,16 --requests 32 --output-len 64 --out "$EV/bench-small"
  tk server logs --host gpu --rank 0 --lines 8
}
tk server stop --host gpu
snap stopped
say "lifecycle phase done; $(left)s left"
fi

# 3b. sm120 applied + torch symmetric memory (a multi-GPU check: the two-shot/multimem path is only
#     built for TP > 1; on capability 9 the patch must leave it as it was).
if [[ $PHASES == *" symm "* ]]; then
  tk patch apply sm120 --host gpu && tk server start baseline --host gpu-symm --timeout 300 && tk smoke --host gpu-symm
  tk server stop --host gpu-symm
  tk patch revert --host gpu
fi

# 4. baseline vs eagle3-dyn on the 32-layer target.
if [[ $PHASES == *" sweep "* ]]; then
if [ "$(left)" -gt 150 ]; then
  apply_dyn_stack
fi
if [ "$(left)" -gt 150 ]; then
  tk bench --host gpu-big --profiles "${SWEEP_PROFILES:-eagle3-dyn,baseline}" --concurrency "${SWEEP_LEVELS:-1,8,32,64}" \
     --output-len 160 --timeout 240 --max-level-seconds 30 --out "${BENCH_OUT:-$EV/bench-big}"
else
  say "skip the sweep: $(left)s left"
fi
fi
# 5. Every profile in one call: one inventory host per profile (own port, NCCL port, state dir),
#    servers started side by side with `invoke server start`, then measured one at a time with
#    `invoke bench --no-restart` (the others idle), put side by side with `invoke bench compare`,
#    a torch profile of PROFILE_LOAD_C concurrent requests per server, and stopped.
#    PS_SETS="a,b,c;d,e" runs the sets one after another (each set side by side, stopped before the
#    next, except the profiles in PS_KEEP, which stay up and are measured again in every set they
#    are named in), for when every profile at once does not fit the GPUs' memory.
if [[ $PHASES == *" psweep "* ]]; then
  apply_dyn_stack
  PS_PROFILES=${PS_PROFILES:-baseline,eagle3-v2,eagle3-v2-dyn,eagle3,eagle3-dyn}
  PS_SETS=${PS_SETS:-$PS_PROFILES}
  i=0; : > /tmp/inv/psweep.toml
  for prof in $(echo "${PS_SETS//[;,]/ }" | tr ' ' '\n' | awk 'NF && !seen[$0]++'); do
    i=$((i + 1))
    # own state dir, HTTP and NCCL ports per host; the servers share the GPUs on purpose
    host "p-$prof" "${PS_PAIR:-big}" "${PS_MEM:-0.7}" ", \"--load-format\", \"dummy\", \"--nccl-port\", \"$((31050 + 100 * i))\"${PS_FLAGS:-}" \
      "SGLANG_SIMULATE_ACC_LEN = \"2.6\"
${PS_ENV:-}" "state_dir = \"/tmp/tkstate/p-$prof\"" "port = $((31000 + 100 * i))
shared_gpu = true" "${PS_KV_TOKENS:-32768}" >> /tmp/inv/psweep.toml
  done
  running=" "
  set_no=0
  IFS=';' read -ra sets <<< "$PS_SETS"
  for set in "${sets[@]}"; do
    set_no=$((set_no + 1)); profs=${set//,/ }
    for prof in $profs; do
      [[ $running == *" $prof "* ]] && continue
      if [ "$(left)" -lt 200 ]; then say "skip starting $prof: $(left)s left"; continue; fi
      tk server start "$prof" --host "p-$prof" --timeout 400 --skip-patch-check > "$EV/start-$prof.txt" 2>&1 &
      running="$running$prof "
      sleep "${PS_STAGGER_S:-8}"
    done
    wait
    for prof in $profs; do tail -n 4 "$EV/start-$prof.txt"; done
    say "set $set_no ($set) started; $(left)s left"
    runs=""
    for prof in ${PS_BENCH_PROFILES-$profs}; do  # PS_BENCH_PROFILES="" skips the sweep
      if [ "$(left)" -lt 60 ]; then say "skip bench $prof: $(left)s left"; continue; fi
      tk bench --host "p-$prof" --no-restart --dataset synthetic --input-len "${PS_INPUT_LEN:-128}" --output-len "${PS_OUTPUT_LEN:-160}" \
         --concurrency "${SWEEP_LEVELS:-1,2,4,8,16,32,64}" --max-level-seconds "${PS_LEVEL_S:-12}" --repeat "${REPEAT:-1}" \
         --out "$EV/bench/set$set_no/$prof" 2>&1 | grep " c=[0-9]*:"
      [ -d "$EV/bench/set$set_no/$prof" ] && runs="$runs,$EV/bench/set$set_no/$prof"
    done
    [ -n "$runs" ] && tk bench compare "${runs#,}" --plot "$EV/bench-compare-set$set_no.png"
    # concurrency 1, alternating servers, to compare two profiles there with less noise
    for round in ${PS_C1_ROUNDS:-}; do
      for prof in ${PS_C1_PROFILES:-eagle3-v2 eagle3-v2-dyn}; do
        [[ " $profs " == *" $prof "* ]] || continue
        tk bench --host "p-$prof" --no-restart --dataset synthetic --input-len 128 --output-len 160 \
           --concurrency 1 --requests "${PS_C1_REQUESTS:-24}" --warmup 1 --out "$EV/bench-c1/$prof-$round" 2>&1 | grep " c=1:"
      done
    done
    for prof in ${PROFILE_PROFILES-baseline eagle3-v2-dyn eagle3-dyn}; do
      [[ " $profs " == *" $prof "* ]] || continue
      if [ "$(left)" -lt 40 ]; then say "skip profile $prof: $(left)s left"; continue; fi
      port=$(python3 -c "import tomllib,sys; print(tomllib.load(open('/tmp/inv/psweep.toml','rb'))['p-$prof']['server']['port'])")
      for c in ${PROFILE_LOAD_C:-64}; do
        timeout 100 python3 gpu/profile_load.py "http://127.0.0.1:$port" "$EV/prof-$prof-c$c" --concurrency "$c" --steps 8
      done
    done
    for prof in $profs; do
      [[ ",${PS_KEEP:-}," == *",$prof,"* && $set_no -lt ${#sets[@]} ]] && continue
      tk server stop --host "p-$prof" > /dev/null 2>&1 &
      running=${running/ $prof / }
    done
    wait
  done
  for f in /tmp/tkstate/p-*/server/*/server.log; do cp "$f" "$EV/$(echo "$f" | cut -d/ -f4).server.log"; done
  say "psweep done; $(left)s left"
fi
# 6. The 32B-shape dummy target (HUGE=1 at setup), servers one after another through
#    `invoke bench --profiles`: a decode step long enough that the GPU sets the pace.
if [[ $PHASES == *" hsweep "* ]]; then
  apply_dyn_stack
  tk bench --host gpu-huge --profiles "${HUGE_PROFILES:-baseline,eagle3-v2-dyn}" --dataset synthetic --input-len 128 \
     --output-len 160 --concurrency "${SWEEP_LEVELS:-1,2,4,8,16,32,64}" --max-level-seconds "${HUGE_LEVEL_S:-10}" --repeat "${REPEAT:-1}" \
     --timeout 300 --out "$EV/bench-huge" 2>&1 | grep -v "━\|^ *$"
  say "hsweep done; $(left)s left"
fi
# 7. `invoke rollout` (issue #27) onto a running stock eagle3-v2 server: dyn-disable with
#    eagle3-v2-dyn, which keeps; back to stock the same way; then the user's hand-made bypass as a
#    patchset (gpu/patchsets/naive-bypass, v1 worker, so profile eagle3): the smoke's burst (8 > its
#    threshold 4) breaks it and the toolkit rolls back by itself to the stock eagle3-v2 server, which
#    must pass smoke with the GPU memory of the stock server before it.
if [[ $PHASES == *" rollout "* ]]; then
  tk patch revert --host gpu > /dev/null
  tk server start eagle3-v2 --host gpu --timeout 300 && snap rollout-stock
  tk rollout dyn-disable --profile eagle3-v2-dyn --host gpu --dry-run
  tk rollout dyn-disable --profile eagle3-v2-dyn --host gpu --json > "$EV/rollout-1-keep.json"
  tk rollout --status --host gpu
  tk rollout dyn-disable --revert --profile eagle3-v2 --host gpu --json > "$EV/rollout-2-back.json"
  snap rollout-stock-again
  TOOLKIT_PATCHSETS=$PWD/gpu/patchsets tk rollout naive-bypass --profile eagle3 --host gpu --json \
    > "$EV/rollout-3-naive.json"
  snap rollout-rolled-back
  for f in "$EV"/rollout-*.json; do
    python3 -c "import json,sys; a=json.load(open(sys.argv[1])); [print(sys.argv[1].rsplit('/',1)[1], h['host'], h['outcome'],
      '|', h['before'], '->', h['after'], '|', '; '.join(f\"{g['name']}: {g['status']} {g['seconds']}s\" for g in h['gates']),
      '| failed:', h['failed_check'][:300], '|', h['rank_errors'], h['log_paths']) for h in a['hosts']]" "$f"
  done
  python3 - "$EV" <<'PY'
import csv, sys
ev = sys.argv[1]
def used(name):
    return {r[0].strip(): int(r[1]) for r in csv.reader(open(f"{ev}/nvsmi-{name}.query-gpu.csv"))}
stock, back = used("rollout-stock"), used("rollout-rolled-back")
for gpu in stock:
    print(f"GPU{gpu}: stock eagle3-v2 {stock[gpu]} MiB, after the rollback {back.get(gpu)} MiB "
          f"({back.get(gpu, 0) - stock[gpu]:+d} MiB)")
PY
  tk rollout --status --host gpu
  tk smoke --host gpu
  tk server stop --host gpu
  cp -r "${TOOLKIT_CACHE:-.tkwheels/cache}/rollouts" "$EV/rollout-journals" 2>/dev/null
  cp -r /tmp/site/.toolkit/rollout "$EV/rollout-host" 2>/dev/null
  say "rollout phase done; $(left)s left"
fi
grep -h "plain step uses\|Dynamic speculation disable\|Traceback\|Error" /tmp/site/.toolkit/server/*/server.log /tmp/tkstate/p-*/server/*/server.log 2>/dev/null \
  | sed 's/^\[[^]]*\] //' | sort | uniq -c | sort -rn | head -20
tk patch revert --host gpu && tk patch verify --host gpu
say "done"
