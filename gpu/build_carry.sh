#!/bin/bash
# One command, on the dev machine from a clean clone (repo root, PyPI reachable, the dev venv made
# by README's test command), that builds every folder the GPU calls carry:
#   .whl1 .whl2 .whl3  the trimmed SGLang 0.5.11 site (gpu/fetch_wheels.sh + gpu/pack_site.sh)
#   .tkwheels          the toolkit's control side for `--host local` runs on the device (run_toolkit.sh,
#                      facts_interconnect.sh): the wheels the device image lacks (invoke, GitPython,
#                      gitdb, smmap, unidiff, at the dev venv's versions) and, in .tkwheels/cache, the
#                      sglang wheel and the compiled images of every shipped patchset (the device may
#                      have no git and has no network)
# Usage: bash gpu/build_carry.sh [--tkwheels-only]
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[build_carry] $*"; }
[ -x .venv/bin/invoke ] || { echo "needs the dev venv first: python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'" >&2; exit 1; }
if [ "${1:-}" != "--tkwheels-only" ]; then
  say "trimmed SGLang site (.whl1 .whl2 .whl3)"
  bash gpu/fetch_wheels.sh
  bash gpu/pack_site.sh
fi
say "toolkit control side (.tkwheels)"
rm -rf .tkwheels && mkdir -p .tkwheels/cache
pins=$(.venv/bin/python -m pip freeze | grep -i -E '^(invoke|gitpython|gitdb|smmap|unidiff)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .tkwheels $pins
for name in $(ls patchsets) ""; do   # each patchset alone, then the whole stack
  TOOLKIT_CACHE=$PWD/.tkwheels/cache .venv/bin/invoke patch check $name >/dev/null
  say "compiled patch images: ${name:-all patchsets stacked}"
done
rm -rf .tkwheels/cache/edit   # a whole sglang tree, only for `invoke patch edit`
du -sh .whl1 .whl2 .whl3 .tkwheels 2>/dev/null || true
say "carry: [\".whl1\", \".whl2\", \".whl3\", \".tkwheels\"] (64 MiB per call at most)"
