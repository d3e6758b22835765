#!/usr/bin/env bash
# Applies the fork-style D3S patch to an OpenRLHF 0.11.2 checkout or installed copy, so that upstream's own
# `python -m openrlhf.cli.train_ppo_ray ... --d3s.*` hands the run to the installed d3s_openrlhf package.
#
#   bash patches/apply.sh [DIR]   # DIR holds the `openrlhf/` package: a checkout's root or site-packages;
#                                 # default: where `python3 -c 'import openrlhf'` finds it (PYTHON=... to choose)
# Refuses (exit 1, nothing changed) if the patch does not apply cleanly; a second run is a no-op.
set -euo pipefail
PATCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/openrlhf-0.11.2-d3s.patch"
DIR="${1:-$("${PYTHON:-python3}" -c 'import os, openrlhf; print(os.path.dirname(os.path.dirname(openrlhf.__file__)))')}"
TARGET="$DIR/openrlhf/cli/train_ppo_ray.py"
[[ -f "$TARGET" ]] || { echo "apply.sh: no openrlhf/cli/train_ppo_ray.py under $DIR" >&2; exit 1; }
if patch -p1 -d "$DIR" --dry-run --reverse --force --silent <"$PATCH" >/dev/null 2>&1; then
  echo "apply.sh: already applied to $TARGET"
  exit 0
fi
if ! patch -p1 -d "$DIR" --dry-run --forward --silent <"$PATCH" >/dev/null; then
  echo "apply.sh: the patch does not apply cleanly to $TARGET (it targets OpenRLHF 0.11.2)" >&2
  exit 1
fi
patch -p1 -d "$DIR" --forward --silent <"$PATCH"
echo "apply.sh: patched $TARGET"
