#!/usr/bin/env bash
# Llama3.1-8B-Instruct: GSPO + D3S-I
# Setting: GSPO + D3S-I: GSPO's sequence-level ratio (clip 3e-4 / 4e-4, from the GSPO paper) with intra-group
#   D3S (N 8 -> 32, K 5% -> 20%).
# Paper reports: no figure in d3s-spec.md (GSPO + D3S is reported for Qwen2.5-Math-7B only); intra-group as
#   the paper advises for Llama.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/llama3.1-8b-instruct/gspo_d3s_i.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=llama3.1-8b-instruct
SETTING=gspo_d3s_i
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
