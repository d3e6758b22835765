#!/usr/bin/env bash
# Qwen2.5-Math-7B: GRPO baseline
# Setting: GRPO baseline: PPO-clip surrogate on group-normalised advantages, every rollout trained
#   (--d3s.preset grpo: nothing swapped).
# Paper reports: D3S Table 1 (avg Pass@1 / Pass@8 over AIME24, AIME25, AMC23, GSM8K, MATH, Minerva,
#   OlympiadBench): GRPO 29.8 / 53.1.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated on the same GPUs with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-7b/grpo.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-7b
SETTING=grpo
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
