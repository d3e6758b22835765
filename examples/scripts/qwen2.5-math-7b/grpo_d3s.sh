#!/usr/bin/env bash
# Qwen2.5-Math-7B: GRPO + D3S
# Setting: GRPO + D3S: cross-group max-variance selection of rollouts on full-group advantages (not
#   renormalised), tokens kept by |A_it| x H_it, dynamic schedule N 8 -> 32 rollouts per prompt and K 5% ->
#   20% tokens, linear in training progress.
# Paper reports: D3S Table 1: GRPO+D3S 34.3 / 56.8 avg Pass@1 / Pass@8 (GRPO 29.8 / 53.1); 2.04x faster than
#   GRPO with < 20% of the tokens.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated on the same GPUs with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-7b/grpo_d3s.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-7b
SETTING=grpo_d3s
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
