#!/usr/bin/env bash
# Llama3.1-8B-Instruct: GRPO + D3S-I
# Setting: GRPO + D3S-I: D3S with intra-group selection (N of each prompt's G rollouts), same tokens and
#   schedule (N 8 -> 32, K 5% -> 20%).
# Paper reports: D3S Table 1, Llama3.1-8B: GRPO+D3S 23.8 / 40.2 (GRPO 20.5 / 32.4). The paper found
#   cross-group selection unstable on this unaligned model and intra-group stable, hence D3S-I here.
# Hardware assumed: 1 node with 8x 80 GB GPUs (A100-80G / H100); ZeRO-3; actor, reference and 8 vLLM engines
#   (TP 1) colocated with sleep mode.
# Chosen by us: G = 32, B = 128 prompts, train batch 128, lr 1e-6, KL 1e-3, 3 episodes of MATH train, 4096
#   tokens, eval every 20 steps (see common.sh; every value can be overridden from the environment).
# Usage: RAY_ADDRESS=http://head:8265 bash examples/scripts/llama3.1-8b-instruct/grpo_d3s_i.sh [extra flags]
set -euo pipefail
MODEL_PROFILE=llama3.1-8b-instruct
SETTING=grpo_d3s_i
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
d3s_launch "$@"
