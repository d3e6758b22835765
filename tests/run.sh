#!/usr/bin/env bash
# The test command of the README: builds the CPU environment from nothing (examples/cpu/setup_env.sh,
# idempotent) and runs the whole suite: the pure core, the OpenRLHF integration, the examples and the
# end-to-end runs of the real Ray pipeline, after the linter (ruff.toml). Extra arguments go to pytest (e.g.
# `-m "not e2e"`). On a GPU machine (no Ray or vLLM needed), `pytest -m cuda tests/core tests/cuda` runs the CUDA
# tests, which this CPU suite collects and skips. It ends with its wall time (environment, linter and pytest):
# CI stops it at 90 minutes, and the suite is kept within 40 on the 2-core VM (a slow day takes half again).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash examples/cpu/setup_env.sh
PY="${D3S_VENV:-$ROOT/.venv}/bin/python"
LINTED=(setup.py d3s_openrlhf tests benchmarks)  # every tracked .py; ruff format fixes what --check finds
"$PY" -m ruff check "${LINTED[@]}"
"$PY" -m ruff format --check "${LINTED[@]}"
pytest_start=$SECONDS
rc=0
"$PY" -m pytest -ra "$@" || rc=$?
echo "[tests/run.sh] wall time $((SECONDS / 60)) min $((SECONDS % 60)) s (pytest $(((SECONDS - pytest_start) / 60)) min $(((SECONDS - pytest_start) % 60)) s), exit $rc"
exit "$rc"
