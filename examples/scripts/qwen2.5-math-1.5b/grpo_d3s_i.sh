#!/usr/bin/env bash
# Qwen2.5-Math-1.5B: GRPO + D3S-I
# Setting: GRPO + D3S-I: D3S with intra-group selection (N of each prompt's G rollouts), same tokens and
#   schedule (N 8 -> 32, K 5% -> 20%).
# Paper reports: no figure for this model in d3s-spec.md.
# Hardware assumed: 1 node with 4x 80 GB GPUs (A100-80G / H100; 40 GB GPUs work with smaller micro-batches);
#   ZeRO-2; actor, reference and 4 vLLM engines colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-1.5b/grpo_d3s_i.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-1.5b
SETTING=grpo_d3s_i
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
