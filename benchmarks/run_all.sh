#!/usr/bin/env bash
# Regenerate every benchmark and benchmarks/RESULTS.md with its plots (about 45 minutes on 2 CPU cores).
# Run from anywhere; builds .venv first if needed. Leave the machine otherwise idle: the figures are wall times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/cpu/setup_env.sh
PY=.venv/bin/python
"$PY" benchmarks/bench_learning.py --out benchmarks/results
"$PY" benchmarks/bench_step_cost.py --out benchmarks/results
"$PY" benchmarks/bench_selection.py
"$PY" benchmarks/report.py --results benchmarks/results
