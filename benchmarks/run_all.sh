#!/usr/bin/env bash
# Regenerate every benchmark and benchmarks/RESULTS.md with its plots and JSON. Run from anywhere; builds .venv
# first if needed. Leave the machine otherwise idle: the figures are wall times. Parts run alone, on 2 CPU cores:
#   step cost + selection + memory + forward: about 40 minutes (bench_forward.py: 15, measured 2026-11-25);
#   on a GPU machine, separately (torch, transformers, deepspeed, flash-attn, openrlhf; about 4 minutes on an H200,
#   2026-11-26): PYTHONPATH=$PWD python benchmarks/bench_forward_gpu.py, then bench_actor_gpu.py and
#   bench_actor_gpu.py --shapes qwen2.5-1.5b qwen2.5-7b --checkpointing --repeats 3 --json
#   benchmarks/results/actor_gpu_full_depth.json, and pytest -m cuda tests/core tests/cuda;
#   the speed study (bench_speed.py: the learning-rate sweep, then the study; resumable, each run appended): about
#   9 hours measured on 2026-11-27 (160 runs of 2.5-4 minutes, two SFT warm starts of 5 minutes);
#   bench_evaluate.py: about 3 minutes (2026-11-25);
#   bench_lora_sync.py: a few minutes per tree (two engines each);
#   report.py: seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/cpu/setup_env.sh
PY=.venv/bin/python
"$PY" benchmarks/bench_step_cost.py --out benchmarks/results
"$PY" benchmarks/bench_selection.py
"$PY" benchmarks/bench_memory.py
"$PY" benchmarks/bench_forward.py
"$PY" benchmarks/bench_speed.py --out benchmarks/results
PYTHONPATH=$PWD "$PY" benchmarks/bench_evaluate.py
"$PY" benchmarks/bench_lora_sync.py  # the merged sync; the adapter it was measured against: commit 25a380c, see its docstring
"$PY" benchmarks/report.py --results benchmarks/results
