#!/usr/bin/env bash
# Run one test N times in a row from the checkout root; stop at the first failure.
# usage: bash docs/evidence/smoke-stream-30-passes/repeat.sh [N] [TEST]
set -u
n=${1:-30}
test=${2:-tests/client/test_cli.py::test_smoke_and_bench_on_an_inventory_host}
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider "$test" > "/tmp/repeat-$i.log" 2>&1; then r=pass; else r=FAIL; fi
  echo "$i $r $(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg) $(date -u +%H:%M:%S)"
  [ "$r" = FAIL ] && exit 1
done
