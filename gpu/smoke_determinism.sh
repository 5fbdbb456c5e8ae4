#!/bin/bash
# The smoke's determinism check on the GPU, both outcomes (issue #13): two tiny "sharp" servers
# (context-dependent greedy output) side by side, one on the site as provisioned and one on a
# copy whose greedy sampler adds noise to the logits (a regression that changes outputs at
# temperature 0), each checked by toolkit/smoke.py. Run from the repo root with .whl1 .whl2 .whl3:
#   bash gpu/smoke_determinism.sh 2>&1 | tee $OUT/run.log
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/dyn-logs
OUT=/tmp/dyn-setup bash gpu/run_dyn.sh setup 2>&1 | tail -n 2
. gpu/device_env.sh
rm -rf /tmp/noisy && mkdir -p /tmp/noisy && cp -r /tmp/site/sglang /tmp/noisy/
SAMPLER=/tmp/noisy/sglang/srt/layers/sampler.py
sed -i 's/batch_next_token_ids = torch.argmax(logits, -1)$/batch_next_token_ids = torch.argmax(logits + torch.randn_like(logits) * logits.std(-1, keepdim=True), -1)/' $SAMPLER
grep -c "torch.randn_like(logits)" $SAMPLER | sed 's/^/noisy greedy sampler lines: /'
start() {  # start NAME PORT SITE
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$3${STUBS:+:$STUBS} python3 -m sglang.launch_server \
    --model-path /tmp/models/target-sharp --host 127.0.0.1 --port $2 --nccl-port $(( $2 + 5000 )) \
    --mem-fraction-static 0.15 --attention-backend triton --sampling-backend pytorch \
    --grammar-backend none --disable-piecewise-cuda-graph --cuda-graph-max-bs 16 --random-seed 0 \
    > /tmp/dyn-logs/$1.log 2>&1 &
}
start clean 30000 /tmp/site
start noisy 30010 /tmp/noisy:/tmp/site
for port in 30000 30010; do
  python3 -c "
import sys, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2); sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit('port $port: no health after 120 s')"
done
PYTHONPATH=/tmp/site${STUBS:+:$STUBS} python3 gpu/smoke_device.py $OUT/smoke_determinism.json \
  clean=http://127.0.0.1:30000=/tmp/dyn-logs/clean.log noisy=http://127.0.0.1:30010=/tmp/dyn-logs/noisy.log
pkill -f "sglang.launch_server" ; sleep 3
tar -C /tmp/dyn-logs -czf $OUT/logs.tgz clean.log noisy.log
