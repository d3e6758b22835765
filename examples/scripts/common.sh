# shellcheck shell=bash
# Common launcher of the paper-scale examples. Sourced by examples/scripts/<model>/<setting>.sh, which set
# MODEL_PROFILE and SETTING and then call `d3s_launch "$@"`. Everything below can be overridden from the
# environment; extra arguments are appended to the training command (the last occurrence of a flag wins,
# e.g. `bash qwen2.5-math-7b/grpo_d3s.sh --train.num_episodes 1`).
#
# What it runs: `ray job submit ... -- python3 -m d3s_openrlhf.cli.train_ppo_ray <OpenRLHF 0.11.2 flags>
# <--d3s.* flags>`: upstream's PPO/GRPO trainer with D3S / PODS down-sampling plugged in.
#
# Getting the plugin to every Ray worker (D3S_SHIP):
#   working_dir (default)  the checkout is uploaded as the job's runtime-env working_dir (Ray puts it on
#                          PYTHONPATH and makes it the cwd of the driver and of every actor), so the rollout,
#                          actor and reference workers import d3s_openrlhf from it, and the relative paths below
#                          (reward file, data under the checkout) resolve on every node. The nodes need only
#                          OpenRLHF 0.11.2 + its stack and math-verify. Ray skips .gitignore'd files and the
#                          excludes below; the upload must stay under Ray's package limit (~500 MiB).
#   installed              d3s-openrlhf is already pip-installed on every node (same image everywhere):
#                          nothing is uploaded, the reward file is the installed one, and relative DATA /
#                          EVAL_DATA / CKPT_ROOT paths are made absolute against the current directory (they
#                          must exist on the nodes: shared filesystem or single node).
#   RUNTIME_ENV_JSON       a complete runtime env of your own (e.g. {"pip": [...]}) replaces either.
#   D3S_RUNTIME_ENV_VARS   a JSON object of extra environment variables for the job's driver and workers, added
#                          to the env_vars of either mode above (e.g. '{"HF_HUB_OFFLINE": "1"}').
# We chose working_dir over py_modules because the reward file is loaded by path (OpenRLHF's
# --reward.remote_url), and only working_dir makes one relative path valid on every node.
#
# Dry runs: D3S_LAUNCH replaces the `ray job submit ... -- python3 -m ...` prefix (for example
# D3S_LAUNCH="python -m d3s_openrlhf.cli.train_ppo_ray" and a trailing --d3s.dry_run validates the whole
# command line without Ray); D3S_PRINT_ONLY=1 prints the command instead of running it.
#
# Hyperparameters. From the papers (see each setting script): the D3S schedule N 8 -> 32 rollouts kept per
# prompt and K 5% -> 20% tokens kept, linear in training progress; cross-group selection with full-group
# advantages (D3S), intra-group (D3S-I); PODS = intra-group max-variance on rewards with advantages recomputed
# on the kept subset; GSPO = sequence-level ratio (clip range 3e-4 / 4e-4 from the GSPO paper). Everything else
# is our choice (the D3S paper's full recipe is not public):
#   G = rollout.n_samples_per_prompt = 32: the smallest G with G >= max N = 32; at the end of the schedule
#       D3S keeps every rollout, which is the paper's "mild late". G = 64 would keep selecting until the end
#       but doubles generation.
#   B = rollout.batch_size = 128 prompts (4096 rollouts a step), train.batch_size = 128 rollouts per
#       optimizer step, rollout.micro_batch_size x data-parallel size = 64: the D3S batch invariant is that
#       every kept count is a multiple of lcm(train.batch_size, rollout.micro_batch_size x dp) = 128; kept
#       counts are N x B = 128 N, so every N of the schedule is legal as it is (no rounding), as are PODS's
#       16 and D1S/D2S's 20 (the legal-count rounding of d3s_openrlhf would otherwise round up to the next
#       multiple: check with --d3s.dry_run after changing any of these). GRPO then takes 32 optimizer steps per
#       rollout step, D3S 8 -> 32.
#   group_norm advantages (GRPO), KL loss k3 with coefficient 1e-3, actor lr 1e-6 (upstream default scheduler,
#       warm-up 3%), temperature 1.0, 3 episodes over MATH (lighteval) train (7,500 problems: ~58 steps an
#       episode, ~175 in all), prompt + response <= 4096 tokens (Qwen2.5-Math's context) with up to 3072 new
#       tokens, evaluation every 20 steps with 8 samples per prompt at temperature 0.6 (pass@1 and pass@8, as
#       the paper reports), bf16, ZeRO-3 (ZeRO-2 for 1.5B), all models colocated with vLLM sleep mode.
#   The reward is d3s_openrlhf/rewards/math_reward.py (math-verify on the last \boxed{}; no format bonus).
#   LoRA (LORA_RANK > 0, the qwen2.5-3b-instruct profile: rank 64, alpha 64, all linear layers): the entrypoint
#       syncs the merged weights to vLLM (README, LoRA); LORA_RANK=0 (every other profile) trains all weights.

D3S_EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
D3S_ROOT="$(cd "$D3S_EXAMPLES_DIR/../.." && pwd)"

_d3s_profile() {
    # Hardware and memory-driven settings per model (chosen by us; 80 GB GPUs: A100-80G / H100 / H800).
    case "$MODEL_PROFILE" in
        qwen2.5-math-7b)
            : "${MODEL:=Qwen/Qwen2.5-Math-7B}"
            : "${GPUS_PER_NODE:=8}" "${ZERO_STAGE:=3}" "${TRAIN_MICRO_BATCH:=4}" "${ROLLOUT_MICRO_BATCH:=8}" ;;
        qwen2.5-math-1.5b)
            : "${MODEL:=Qwen/Qwen2.5-Math-1.5B}"
            : "${GPUS_PER_NODE:=4}" "${ZERO_STAGE:=2}" "${TRAIN_MICRO_BATCH:=8}" "${ROLLOUT_MICRO_BATCH:=16}" ;;
        llama3.1-8b-instruct)
            : "${MODEL:=meta-llama/Llama-3.1-8B-Instruct}"
            : "${GPUS_PER_NODE:=8}" "${ZERO_STAGE:=3}" "${TRAIN_MICRO_BATCH:=4}" "${ROLLOUT_MICRO_BATCH:=8}" ;;
        qwen2.5-3b-instruct)
            # PODS's own setting: GSM8K, one GPU, LoRA (n = 64 rollouts per prompt, m = 16 kept)
            : "${MODEL:=Qwen/Qwen2.5-3B-Instruct}"
            : "${GPUS_PER_NODE:=1}" "${ZERO_STAGE:=2}" "${TRAIN_MICRO_BATCH:=8}" "${ROLLOUT_MICRO_BATCH:=16}"
            : "${DATA:=data/train_gsm8k.jsonl}" "${EVAL_DATA=data/eval_gsm8k.jsonl}"
            : "${N_SAMPLES:=64}" "${ROLLOUT_BATCH:=8}" "${TRAIN_BATCH:=128}" "${LR:=1e-5}"
            : "${MAX_LEN:=1536}" "${MAX_NEW_TOKENS:=1024}" "${LORA_RANK:=64}" "${LORA_ALPHA:=64}" ;;
        *)
            echo "common.sh: unknown MODEL_PROFILE '$MODEL_PROFILE'" >&2
            return 1 ;;
    esac
}

_d3s_setting() {
    # SETTING -> the policy loss and the --d3s.* flags (numbers from the papers, see the module header).
    local d3s_schedule=(--d3s.n_init 8 --d3s.n_final 32 --d3s.k_init 0.05 --d3s.k_final 0.2 --d3s.schedule linear)
    local gspo=(--actor.policy_loss_type gspo --actor.eps_clip_low_high 3e-4 4e-4)
    local ppo=(--actor.policy_loss_type ppo --actor.eps_clip 0.2)
    case "$SETTING" in
        grpo)       SETTING_ARGS=("${ppo[@]}" --d3s.preset grpo) ;;
        grpo_d3s)   SETTING_ARGS=("${ppo[@]}" --d3s.preset d3s "${d3s_schedule[@]}") ;;
        grpo_d3s_i) SETTING_ARGS=("${ppo[@]}" --d3s.preset d3s-i "${d3s_schedule[@]}") ;;
        gspo_d3s)   SETTING_ARGS=("${gspo[@]}" --d3s.preset d3s "${d3s_schedule[@]}") ;;
        gspo_d3s_i) SETTING_ARGS=("${gspo[@]}" --d3s.preset d3s-i "${d3s_schedule[@]}") ;;
        grpo_pods)  SETTING_ARGS=("${ppo[@]}" --d3s.preset pods --d3s.n_init 16 --d3s.schedule constant) ;;
        grpo_d1s)   SETTING_ARGS=("${ppo[@]}" --d3s.preset d1s --d3s.n_init 20 --d3s.schedule constant) ;;
        grpo_d2s)
            SETTING_ARGS=("${ppo[@]}" --d3s.preset d2s --d3s.n_init 20 --d3s.k_init 0.125 --d3s.schedule constant) ;;
        *)
            echo "common.sh: unknown SETTING '$SETTING'" >&2
            return 1 ;;
    esac
}

_d3s_abs() {
    case "$1" in
        "" | /*) printf '%s' "$1" ;;
        *) printf '%s/%s' "$PWD" "$1" ;;
    esac
}

_d3s_runtime_env() {
    # The runtime env JSON (see D3S_SHIP above); env_vars carry the reward settings to the rollout actors.
    "${PYTHON:-python3}" - "$D3S_SHIP" "$D3S_ROOT" <<'PY'
import json, os, sys
ship, root = sys.argv[1], sys.argv[2]
env = {"env_vars": {name: os.environ[name] for name in (
    "D3S_REWARD_FORMAT_WEIGHT", "D3S_REWARD_TIMEOUT", "D3S_REWARD_WORKERS") if os.environ.get(name)}}
env["env_vars"].update(json.loads(os.environ.get("D3S_RUNTIME_ENV_VARS") or "{}"))
if ship == "working_dir":
    env["working_dir"] = root
    env["excludes"] = [".git/", ".venv/", "build/", "out/", "ckpt/", "*.egg-info/", "tests/", "benchmarks/"]
print(json.dumps(env))
PY
}

d3s_launch() {
    _d3s_profile || return 1
    _d3s_setting || return 1
    : "${D3S_SHIP:=working_dir}"
    case "$D3S_SHIP" in working_dir | installed) ;; *)
        echo "common.sh: D3S_SHIP must be working_dir or installed, not '$D3S_SHIP'" >&2
        return 1 ;;
    esac

    : "${RAY_ADDRESS:=http://127.0.0.1:8265}"
    : "${NNODES:=1}"
    : "${DATA:=data/train_math.jsonl}"          # python -m d3s_openrlhf.data.prepare --dataset math-lighteval
    : "${EVAL_DATA=data/eval_math.jsonl}"       # prepare --dataset eval-suite; EVAL_DATA= turns eval off
    : "${CKPT_ROOT:=$HOME/d3s-openrlhf-runs}"
    : "${RUN_NAME:=${MODEL_PROFILE}_${SETTING}}"
    : "${N_SAMPLES:=32}" "${ROLLOUT_BATCH:=128}" "${TRAIN_BATCH:=128}"
    : "${NUM_EPISODES:=3}" "${LR:=1e-6}" "${KL_COEF:=1e-3}" "${SEED:=42}"
    : "${MAX_LEN:=4096}" "${MAX_NEW_TOKENS:=3072}"
    : "${EVAL_STEPS:=20}" "${SAVE_STEPS:=20}" "${VLLM_GPU_UTIL:=0.6}" "${LORA_RANK:=0}" "${LORA_ALPHA:=16}"
    local reward="d3s_openrlhf/rewards/math_reward.py"
    if [ "$D3S_SHIP" = installed ]; then
        reward="$("${PYTHON:-python3}" -c 'import importlib.util as u; print(u.find_spec("d3s_openrlhf").submodule_search_locations[0])')/rewards/math_reward.py"
        DATA="$(_d3s_abs "$DATA")" EVAL_DATA="$(_d3s_abs "$EVAL_DATA")" CKPT_ROOT="$(_d3s_abs "$CKPT_ROOT")"
    fi
    : "${REWARD_FUNC:=$reward}"
    local eval_args=()
    if [ -n "$EVAL_DATA" ]; then
        eval_args=(--eval.dataset "$EVAL_DATA" --eval.steps "$EVAL_STEPS" --eval.n_samples_per_prompt 8
                   --eval.temperature 0.6)
    fi

    local lora_args=()
    if [ "$LORA_RANK" -gt 0 ]; then
        lora_args=(--ds.lora.rank "$LORA_RANK" --ds.lora.alpha "$LORA_ALPHA")
    fi

    local args=(
        --actor.model_name_or_path "$MODEL"
        --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$GPUS_PER_NODE"
        --ref.num_nodes "$NNODES" --ref.num_gpus_per_node "$GPUS_PER_NODE"
        --vllm.num_engines "$((NNODES * GPUS_PER_NODE))" --vllm.tensor_parallel_size 1
        --vllm.gpu_memory_utilization "$VLLM_GPU_UTIL" --vllm.enable_sleep --ds.enable_sleep
        --train.colocate_all
        --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16 --ds.packing_samples
        --actor.gradient_checkpointing_enable
        "${lora_args[@]}"
        --reward.remote_url "$REWARD_FUNC"
        --data.prompt_dataset "$DATA" --data.input_key prompt --data.label_key label --data.apply_chat_template
        --data.max_len "$MAX_LEN" --rollout.max_new_tokens "$MAX_NEW_TOKENS"
        --rollout.n_samples_per_prompt "$N_SAMPLES" --rollout.batch_size "$ROLLOUT_BATCH"
        --rollout.micro_batch_size "$ROLLOUT_MICRO_BATCH" --rollout.temperature 1.0
        --train.batch_size "$TRAIN_BATCH" --train.micro_batch_size "$TRAIN_MICRO_BATCH"
        --train.num_episodes "$NUM_EPISODES" --train.max_epochs 1 --train.seed "$SEED"
        --algo.advantage.estimator group_norm
        --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef "$KL_COEF"
        --actor.adam.lr "$LR"
        "${eval_args[@]}"
        --ckpt.output_dir "$CKPT_ROOT/$RUN_NAME" --ckpt.path "$CKPT_ROOT/$RUN_NAME/ds_ckpt"
        --ckpt.save_steps "$SAVE_STEPS" --ckpt.save_hf
        --logger.tensorboard_dir "$CKPT_ROOT/$RUN_NAME/tensorboard"
        "${SETTING_ARGS[@]}"
        --d3s.seed "$SEED"
    )

    local launch
    if [ -n "${D3S_LAUNCH:-}" ]; then
        read -r -a launch <<<"$D3S_LAUNCH"
    else
        local submit_extra=()
        [ -n "${RAY_SUBMIT_ARGS:-}" ] && read -r -a submit_extra <<<"$RAY_SUBMIT_ARGS"
        launch=(ray job submit --address "$RAY_ADDRESS"
                --runtime-env-json "${RUNTIME_ENV_JSON:-$(_d3s_runtime_env)}" "${submit_extra[@]}"
                -- python3 -m d3s_openrlhf.cli.train_ppo_ray)
    fi

    # Relative paths mean the same here as in the uploaded working_dir: run from the checkout's root.
    cd "$D3S_ROOT" || return 1
    if [ "${D3S_PRINT_ONLY:-0}" = 1 ]; then
        printf '%q ' "${launch[@]}" "${args[@]}" "$@"
        printf '\n'
        return 0
    fi
    "${launch[@]}" "${args[@]}" "$@"
}
