#!/usr/bin/env bash
# Qwen2.5-Math-7B: GRPO + PODS
# Setting: GRPO + PODS: intra-group max-variance down-sampling on rewards, advantages recomputed over the kept
#   subset; m = 16 kept of n = G = 32 (PODS used n = 64, m = 16; m = 16 is the project's preset, our choice).
# Paper reports: D3S Table 1: GRPO+PODS 34.1 / 54.4 avg Pass@1 / Pass@8 (GRPO+D3S 34.3 / 56.8).
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated on the same GPUs with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-7b/grpo_pods.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-7b
SETTING=grpo_pods
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
