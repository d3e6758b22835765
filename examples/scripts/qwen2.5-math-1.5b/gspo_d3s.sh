#!/usr/bin/env bash
# Qwen2.5-Math-1.5B: GSPO + D3S
# Setting: GSPO + D3S: GSPO's sequence-level ratio (clip 3e-4 / 4e-4, from the GSPO paper) with D3S
#   (cross-group, N 8 -> 32, K 5% -> 20%).
# Paper reports: no figure for this model in d3s-spec.md.
# Hardware assumed: 1 node with 4x 80 GB GPUs (A100-80G / H100; 40 GB GPUs work with smaller micro-batches);
#   ZeRO-2; actor, reference and 4 vLLM engines colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/qwen2.5-math-1.5b/gspo_d3s.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=qwen2.5-math-1.5b
SETTING=gspo_d3s
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
