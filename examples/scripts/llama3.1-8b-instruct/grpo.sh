#!/usr/bin/env bash
# Llama3.1-8B-Instruct: GRPO baseline
# Setting: GRPO baseline: PPO-clip surrogate on group-normalised advantages, every rollout trained
#   (--d3s.preset grpo: nothing swapped).
# Paper reports: D3S Table 1, Llama3.1-8B: GRPO 20.5 / 32.4 avg Pass@1 / Pass@8.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/llama3.1-8b-instruct/grpo.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=llama3.1-8b-instruct
SETTING=grpo
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
