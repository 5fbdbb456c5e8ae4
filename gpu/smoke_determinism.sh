#!/bin/bash
# The smoke's determinism check on the GPU, both outcomes (issue #13): two tiny "sharp" servers
# (context-dependent greedy output) side by side, one on the site as provisioned and one on a
# copy whose greedy sampler adds noise to the logits (a regression that changes outputs at
# temperature 0), each checked by toolkit/check/smoke.py. Run from the repo root with .whl1 .whl2 .whl3:
#   bash gpu/smoke_determinism.sh 2>&1 | tee $OUT/run.log
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/dyn-logs
OUT=/tmp/dyn-setup bash gpu/run_dyn.sh setup 2>&1 | tail -n 2
. gpu/device_env.sh
bash gpu/make_noisy_site.sh
PYTHONPATH=/tmp/site${STUBS:+:$STUBS} python3 gpu/smoke_device.py $OUT/smoke_determinism.json
(cd /tmp/dyn-logs && tar -czf $OUT/logs.tgz *.log)
