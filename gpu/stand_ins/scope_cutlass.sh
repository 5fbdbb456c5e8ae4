#!/bin/bash
# Lends the CuTe DSL stand-in (gpu/stand_ins/cutlass) to the modules that import `cutlass` at their
# top, only while they import (gpu/stand_ins/cutlass_scoped.py says why). Run from the repo root:
#   bash gpu/stand_ins/scope_cutlass.sh SITE [MODULE_PATH ...]
# MODULE_PATH is relative to SITE; without any, the paths in gpu/stand_ins/cutlass_scoped_modules.txt.
# Each module moves to MODULE_PATH.real, the shim takes its place, and the stand-in goes beside it in
# `_cutlass_stand_in/`. gpu/run_dyn.sh runs it on the 0.5.23 site where `import cutlass` fails.
set -euo pipefail
site=${1:?usage: scope_cutlass.sh SITE [MODULE_PATH ...]}
shift
[ $# -gt 0 ] || set -- $(grep -v '^#' gpu/stand_ins/cutlass_scoped_modules.txt)
for m in "$@"; do
  [ -f "$site/$m" ] || { echo "scope_cutlass: no $site/$m" >&2; exit 1; }
  mv "$site/$m" "$site/$m.real"
  cp gpu/stand_ins/cutlass_scoped.py "$site/$m"
  mkdir -p "$(dirname "$site/$m")/_cutlass_stand_in"
  cp -r gpu/stand_ins/cutlass "$(dirname "$site/$m")/_cutlass_stand_in/"
done
echo "cutlass stand-in scoped to: $*"
