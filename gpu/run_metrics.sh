#!/bin/bash
# dyn-disable in SGLang's Prometheus metrics, on the device: the patched site (run_dyn.sh setup,
# which applies every diff of patchsets/dyn-disable/<release>/, 0002-dyn-disable-metrics.patch
# included), then gpu/metrics_device.py (an eagle3-v2-dyn server with --enable-metrics through
# load cycles, /metrics scraped to $OUT/scrape.jsonl, final values checked against the log and
# /server_info). Carry [".whl1", ".whl2", ".whl3"]; .whl2 must hold the prometheus_client wheel
# (gpu/fetch_wheels.sh downloads it) unless the image has the package.
#   DYN_THRESHOLD=5 bash gpu/run_metrics.sh [--cycles N] [--interval S] [--tp 2] 2>&1 | tee $OUT/run.log
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash gpu/run_dyn.sh setup || exit 1
. gpu/device_env.sh
export PYTHONPATH=/tmp/site${STUBS:+:$STUBS}
python3 -c "import prometheus_client; print('prometheus_client', prometheus_client.__version__ if hasattr(prometheus_client, '__version__') else '')" \
  || { echo "prometheus_client missing on the device: put its wheel into .whl2 (gpu/fetch_wheels.sh) and carry it"; exit 1; }
python3 gpu/metrics_device.py --out "$OUT" "$@"
