#!/usr/bin/env bash
# Qwen2.5-Math-7B: GSPO + D3S
# Setting: GSPO + D3S: GSPO's sequence-level ratio (clip 3e-4 / 4e-4, from the GSPO paper) with D3S
#   (cross-group, N 8 -> 32, K 5% -> 20%).
# Paper reports: D3S Table 1: GSPO+D3S 35.8 / 56.2 avg Pass@1 / Pass@8 (GRPO 29.8 / 53.1).
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated on the same GPUs with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-7b/gspo_d3s.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-7b
SETTING=gspo_d3s
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
