#!/bin/bash
# One command, on the dev machine from a clean clone (repo root, PyPI reachable, the dev venv made
# by README's test command), that builds every folder the GPU calls carry:
#   .whl1 .whl2 .whl3  the trimmed SGLang 0.5.11 site (gpu/fetch_wheels.sh + gpu/pack_site.sh)
#   .tkwheels          the toolkit's control side for `--host local` runs on the device (run_toolkit.sh,
#                      facts_interconnect.sh): the wheels the device image lacks (invoke, GitPython,
#                      gitdb, smmap, unidiff, at the dev venv's versions) and, in .tkwheels/cache, the
#                      sglang wheel of the site's release and the compiled images of every shipped
#                      patchset for it (the device may have no git and has no network)
# Usage: bash gpu/build_carry.sh [--tkwheels-only | --site-only]
#        TK_PATCHSETS="dyn-disable" bash gpu/build_carry.sh --tkwheels-only: only those patch images
#        SGLANG_RELEASE=0.5.17 bash gpu/build_carry.sh ...: that release's site instead, as
#        .whl1-0.5.17 .whl2 .whl3-0.5.17 (gpu/README.md "SGLang 0.5.17 carry"); 0.5.23 likewise
#        (SGL_KERNEL=0.4.5 for a site that loads on the image's torch: "SGLang 0.5.23 carry")
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[build_carry] $*"; }
. gpu/release.sh
sizes() {  # the carried folders and the tracked files (the run tool copies the checkout too), in MiB
  local folders=$(du -cb "$@" | tail -1 | cut -f1) tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  say "$* = $((folders >> 20)) MiB, tracked files $((tree >> 20)) MiB, total $(((folders + tree) >> 20)) MiB (64 MiB per call at most)"
}
[ "${1:-}" = "--site-only" ] || [ -x .venv/bin/invoke ] || {
  echo "needs the dev venv first: python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]'" >&2; exit 1; }
if [ "${1:-}" != "--tkwheels-only" ]; then
  say "trimmed SGLang $REL site (.whl1$SFX .whl2 .whl3$SFX)"
  bash gpu/fetch_wheels.sh
  bash gpu/pack_site.sh
fi
if [ "${1:-}" = "--site-only" ]; then
  du -sh .whl1$SFX .whl2 .whl3$SFX
  sizes .whl1$SFX .whl2 .whl3$SFX
  exit 0
fi
say "toolkit control side (.tkwheels)"
rm -rf .tkwheels && mkdir -p .tkwheels/cache
pins=$(.venv/bin/python -m pip freeze | grep -i -E '^(invoke|gitpython|gitdb|smmap|unidiff)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .tkwheels $pins
missing=$(for name in $(ls patchsets); do [ -d patchsets/$name/$REL ] || echo $name; done)
# TK_PATCHSETS="a b": compile only those images (each alone, no stack): the rollout call needs
# dyn-disable's alone, and every image is 0.5-1.4 MB of the 64 MiB a call carries
only=${TK_PATCHSETS:-}
for name in ${only:-$(ls patchsets) ""}; do   # each patchset alone, then the whole stack
  # a patchset without diffs for this release, and then the whole stack, has no image
  if [ -n "$name" ] && [ ! -d patchsets/$name/$REL ] || [ -z "$name" ] && [ -n "$missing" ]; then
    say "no patch image: ${name:-all patchsets stacked} ($REL; no diffs for it: $(echo $missing))"; continue
  fi
  # only the carried site's release: its sglang wheel alone is what the device needs (0.5.17's is
  # 22 MB; both together pushed a toolkit call over 64 MiB)
  TOOLKIT_CACHE=$PWD/.tkwheels/cache .venv/bin/invoke patch check $name --release $REL >/dev/null
  say "compiled patch images: ${name:-all patchsets stacked} ($REL)"
done
# the lab's own patchsets (gpu/patchsets: the user's hand-made bypass that the rollout call rolls
# back) are compiled here too: compiling needs git, which the device may lack
for name in $(ls gpu/patchsets); do
  TOOLKIT_PATCHSETS=$PWD/gpu/patchsets TOOLKIT_CACHE=$PWD/.tkwheels/cache .venv/bin/invoke patch check $name \
    --release $REL >/dev/null
  say "compiled patch images: $name (gpu/patchsets, $REL)"
done
rm -rf .tkwheels/cache/edit   # a whole sglang tree, only for `invoke patch edit`
du -sh .whl1$SFX .whl2 .whl3$SFX .tkwheels 2>/dev/null || true
say "carry: [\".whl1$SFX\", \".whl2\", \".whl3$SFX\", \".tkwheels\"] (64 MiB per call at most)"
sizes .whl1$SFX .whl2 .whl3$SFX .tkwheels
