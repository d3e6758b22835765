#!/usr/bin/env bash
# Llama3.1-8B-Instruct: GRPO + D3S
# Setting: GRPO + D3S: cross-group max-variance selection of rollouts on full-group advantages (not
#   renormalised), tokens kept by |A_it| x H_it, dynamic schedule N 8 -> 32 rollouts per prompt and K 5% ->
#   20% tokens, linear in training progress.
# Paper reports: the paper found cross-group selection unstable on Llama3.1-8B-Instruct (intra-group was
#   stable: use grpo_d3s_i.sh); this script reproduces that comparison.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/llama3.1-8b-instruct/grpo_d3s.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=llama3.1-8b-instruct
SETTING=grpo_d3s
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
