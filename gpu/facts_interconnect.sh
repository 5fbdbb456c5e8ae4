#!/bin/bash
# sm120 on the 2-GPU H200 machine (kind nvidia-h200-x2): the interconnect facts, and the sm120
# gates forced to their "on" path where an H200 can take it.
#   raw     the nvidia-smi outputs `invoke facts` parses (topo -m, topo -p2p r/w/a/n, nvlink -s,
#           the PCIe query, the Fabric blocks of -q), then `invoke facts --host h2` (table) and
#           `--json` (printed), and the sm120 prediction (`invoke patch apply sm120 --dry-run`)
#   forced  sm120 applied by the toolkit; a TP=2 server (a config-only Qwen3 target, dummy weights:
#           qwen3.py runs the FlashInfer fusion path, Llama does not) started twice: `stock` (no
#           force: every gate says "stock" on capability 9) and `forced` (fusion on, symm-mem
#           two-shot on without multicast, DeepGEMM off); smoke on each; the "sm120: " lines and
#           what FlashInfer / torch symm-mem said; stop; revert.
# Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, as run_toolkit.sh),
# so the forced symm-mem run is the two-shot kernel without multicast, the PCIe-box path.
#
# Dev machine first (the device has no network and maybe no git; the sm120 image must be in
# the carried cache): bash gpu/build_carry.sh
# Device (carry .whl1 .whl2 .whl3 .tkwheels):
#   BUDGET_S=560 bash gpu/facts_interconnect.sh > $OUT/run.log 2>&1
#   PHASES=raw bash gpu/facts_interconnect.sh      # needs .tkwheels only
set -u
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
OUT=${OUT:-/tmp/out}
EV=/tmp/ev-sm120
rm -rf "$EV"; mkdir -p "$OUT" "$EV"
pack() { for f in /tmp/tkstate-sm120/*/server/*/logs/*.log; do   # every start's own log, named by host
           [ -f "$f" ] && cp "$f" "$EV/$(echo "$f" | cut -d/ -f4)-$(basename "$f")"; done
         tar -C "$EV" -czf "$OUT/evidence-sm120.tgz" .; }
trap pack EXIT
say() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ( $(date +%s) - T0 ) )); }
PHASES=" ${PHASES:-raw forced} "
. gpu/device_env.sh

# 1. What nvidia-smi says, as it says it (the facts parser's input).
raw() { echo; echo "\$ nvidia-smi $*"; nvidia-smi "$@" 2>&1 | tee "$EV/nvsmi-$(echo "$*" | tr ' =,' '___' | cut -c1-40).txt"; echo "[exit ${PIPESTATUS[0]}]"; }
if [[ $PHASES == *" raw "* ]]; then
  raw -L
  raw topo -m
  for cap in r w a n; do raw topo -p2p $cap; done
  raw nvlink -s
  raw --query-gpu=index,name,compute_cap,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max --format=csv
  echo; echo "\$ nvidia-smi -q | grep -A3 Fabric"; nvidia-smi -q > "$EV/nvsmi-q.txt" 2>&1; grep -A3 "^    Fabric" "$EV/nvsmi-q.txt"
fi

# 2. The toolkit, as run_toolkit.sh runs it (control side from .tkwheels, this checkout on PYTHONPATH).
toolkit_side /tmp/inv-sm120
if [[ $PHASES == *" forced "* ]]; then
  DYN_APPLY=0 bash gpu/run_dyn.sh setup 2>&1 | tail -n 3     # pristine /tmp/site + /tmp/models
fi
mkdir -p /tmp/models
# A config-only Qwen3 (2 layers, hidden 512) with the tiny tokenizer of make_models.py.
if [ -d /tmp/models/target-sharp ] && [ ! -d /tmp/models/qwen3-tiny ]; then
  mkdir -p /tmp/models/qwen3-tiny && cp /tmp/models/target-sharp/*token* /tmp/models/target-sharp/*.jinja /tmp/models/qwen3-tiny/ 2>/dev/null
  # (transformers 5 keeps the chat template in chat_template.jinja: without it every chat request is a 400)
  python3 - <<'EOF'
import json
base = json.load(open("/tmp/models/target-sharp/config.json"))
config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 512,
          "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "num_hidden_layers": 2, "vocab_size": base["vocab_size"], "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
          "hidden_act": "silu", "attention_bias": False,
          "bos_token_id": base.get("bos_token_id"), "eos_token_id": base.get("eos_token_id")}
json.dump(config, open("/tmp/models/qwen3-tiny/config.json", "w"), indent=1)
print("qwen3-tiny config written")
EOF
fi
FLAGS='"--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
  "--disable-piecewise-cuda-graph", "--random-seed", "0", "--max-running-requests", "32", "--cuda-graph-max-bs", "32",
  "--load-format", "dummy", "--mem-fraction-static", "0.3", "--max-total-tokens", "32768",
  "--enable-torch-symm-mem", "--enable-flashinfer-allreduce-fusion"'
host() {  # host NAME PORT EXTRA-ENV
  cat <<EOF
[$1]
transport = "local"
python = "python3"
pythonpath = "/tmp/site"
gpus = 2
stack = "gpu"
state_dir = "/tmp/tkstate-sm120/$1"
[$1.server]
tp_size = 2
port = $2
model = "/tmp/models/qwen3-tiny"
flags = [$FLAGS, "--nccl-port", "$(( $2 + 50 ))"]
[$1.server.env]
$(server_env_toml)
$3
EOF
}
{ host h2 31400 ""
  host h2-forced 31400 'SGLANG_SM120_FORCE_FLASHINFER_FUSION = "on"
SGLANG_SM120_FORCE_SYMM_MEM_TWO_SHOT = "on"
SGLANG_SM120_FORCE_DEEP_GEMM = "off"'; } > /tmp/inv-sm120/h2.toml

if [[ $PHASES == *" raw "* ]]; then
  tk facts --host h2
  tk facts --host h2 --json > "$EV/facts.json"
  echo "--- parsed facts (invoke facts --host h2 --json) ---"; cat "$EV/facts.json"
  [ -d /tmp/site/sglang ] && tk patch apply sm120 --host h2 --dry-run
fi

if [[ $PHASES == *" forced "* ]]; then
  tk patch apply sm120 --host h2 && tk patch verify --host h2
  for variant in h2 h2-forced; do   # both share the patched /tmp/site (state_dir differs, same files)
    if [ "$(left)" -lt 150 ]; then say "skip $variant: $(left)s left"; continue; fi
    tk server start baseline --host "$variant" --timeout 300 --skip-patch-check && {
      tk smoke --host "$variant"
      log=$(ls /tmp/tkstate-sm120/$variant/server/*/server.log | head -1)
      echo "--- $variant: sm120 lines and what the features said ---"
      grep -h "sm120: \|FlashInfer workspace\|allreduce fusion\|TorchSymmMemCommunicator\|DeepGEMM\|Traceback" "$log" \
        | sed 's/^\[[^]]*\] //' | sort | uniq -c | sort -rn | head -30
    }
    tk server stop --host "$variant"
  done
  tk patch revert --host h2 && tk patch verify --host h2
fi
say "done"
