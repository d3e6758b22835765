#!/usr/bin/env bash
# Regenerate every benchmark, benchmarks/RESULTS.md with its plots, and the learning study
# (benchmarks/results/learning_study.md). Run from anywhere; builds .venv first if needed. Leave the machine
# otherwise idle: the figures are wall times. Parts run alone:
#   step cost + selection + memory + RESULTS.md: about 35 minutes on 2 CPU cores (bench_forward.py: 10);
#   the study: bench_learning.py --parts pods / --parts d3s (see its docstring for the time of each part).
# RESULTS.md's learning section still reads results/learning.json, the earlier addition-task runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/cpu/setup_env.sh
PY=.venv/bin/python
"$PY" benchmarks/bench_step_cost.py --out benchmarks/results
"$PY" benchmarks/bench_selection.py
"$PY" benchmarks/bench_memory.py
"$PY" benchmarks/bench_forward.py
"$PY" benchmarks/report.py --results benchmarks/results
"$PY" benchmarks/bench_learning.py --out benchmarks/results
"$PY" benchmarks/report.py --study benchmarks/results/learning_study.json --output benchmarks/results/learning_study.md
