#!/bin/bash
# A device call carries the working tree (tracked files) plus the carried folders, 64 MiB in all.
# The stored evidence archives (docs/evidence/**/*.tar.xz) are most of the tracked bytes and no
# device script reads them; a call that carries .tkwheels too can move them aside for its run:
#   bash gpu/evidence_aside.sh out    # before the call: moves them to $ASIDE (default /tmp/evidence-aside)
#   bash gpu/evidence_aside.sh back   # after it: puts them back (git status is clean again)
set -euo pipefail
ASIDE=${ASIDE:-/tmp/evidence-aside}
case "${1:-}" in
  out)
    mkdir -p "$ASIDE"
    git ls-files -z 'docs/evidence/*.tar.xz' | while IFS= read -r -d '' f; do
      mkdir -p "$ASIDE/$(dirname "$f")" && mv "$f" "$ASIDE/$f"
    done
    echo "moved aside: $(find "$ASIDE" -name '*.tar.xz' | wc -l) archive(s), $(du -sh "$ASIDE" | cut -f1) in $ASIDE; 'bash gpu/evidence_aside.sh back' after the call" ;;
  back)
    [ -d "$ASIDE" ] || { echo "nothing aside in $ASIDE"; exit 0; }
    (cd "$ASIDE" && find . -name '*.tar.xz' -print0) | while IFS= read -r -d '' f; do
      mkdir -p "$(dirname "$f")" && mv "$ASIDE/$f" "$f"
    done
    rm -rf "$ASIDE"
    git status --short -- docs/evidence | head -5 ;;
  *) echo "usage: bash gpu/evidence_aside.sh out|back" >&2; exit 2 ;;
esac
