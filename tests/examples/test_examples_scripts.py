"""The paper-scale launch scripts of examples/scripts/: their command lines, batch sizes, and the entrypoint's dry run.

Every script is run for real (bash) with the launcher swapped: ``D3S_PRINT_ONLY=1`` prints the ``ray job submit``
command it would run, and ``D3S_LAUNCH="python -m d3s_openrlhf.cli.train_ppo_ray"`` plus a trailing
``--d3s.dry_run`` runs the whole command line through the entrypoint's validation without Ray.
"""

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from d3s_openrlhf.core.config import D3SConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "scripts"
ENTRYPOINT = ["python3", "-m", "d3s_openrlhf.cli.train_ppo_ray"]

QWEN_SETTINGS = {"grpo", "grpo_d3s", "grpo_d3s_i", "gspo_d3s", "grpo_pods", "grpo_d1s", "grpo_d2s"}
EXPECTED = {
    "qwen2.5-math-7b": QWEN_SETTINGS,
    "qwen2.5-math-1.5b": QWEN_SETTINGS,
    "llama3.1-8b-instruct": {"grpo", "grpo_d3s", "grpo_d3s_i", "gspo_d3s_i", "grpo_pods", "grpo_d1s", "grpo_d2s"},
    "qwen2.5-3b-instruct": {"grpo_pods"},  # PODS's own setting: LoRA, one GPU
}
MODELS = {
    "qwen2.5-math-7b": "Qwen/Qwen2.5-Math-7B",
    "qwen2.5-math-1.5b": "Qwen/Qwen2.5-Math-1.5B",
    "llama3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5-3b-instruct": "Qwen/Qwen2.5-3B-Instruct",
}
PRESETS = {
    "grpo": "grpo",
    "grpo_d3s": "d3s",
    "grpo_d3s_i": "d3s-i",
    "gspo_d3s": "d3s",
    "gspo_d3s_i": "d3s-i",
    "grpo_pods": "pods",
    "grpo_d1s": "d1s",
    "grpo_d2s": "d2s",
}
# Variables common.sh reads: cleared so that the caller's environment cannot change what the tests see.
COMMON_VARS = (
    "MODEL DATA EVAL_DATA RAY_ADDRESS NNODES GPUS_PER_NODE ZERO_STAGE TRAIN_MICRO_BATCH ROLLOUT_MICRO_BATCH "
    "CKPT_ROOT RUN_NAME N_SAMPLES ROLLOUT_BATCH TRAIN_BATCH NUM_EPISODES LR KL_COEF SEED MAX_LEN MAX_NEW_TOKENS "
    "EVAL_STEPS SAVE_STEPS VLLM_GPU_UTIL REWARD_FUNC RUNTIME_ENV_JSON RAY_SUBMIT_ARGS D3S_SHIP D3S_LAUNCH "
    "D3S_PRINT_ONLY D3S_REWARD_FORMAT_WEIGHT D3S_REWARD_TIMEOUT D3S_REWARD_WORKERS PYTHON LORA_RANK LORA_ALPHA"
).split()

ALL_SCRIPTS = sorted(SCRIPTS.glob("*/*.sh"))
SCRIPT_IDS = [f"{p.parent.name}/{p.stem}" for p in ALL_SCRIPTS]


def run_script(script: Path, *extra: str, cwd=None, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in COMMON_VARS}
    env["HOME"] = env.get("HOME", "/tmp")
    env.update(env_overrides)
    return subprocess.run(
        ["bash", str(script), *extra], cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def printed_command(script: Path, *extra: str, **env) -> list:
    done = run_script(script, *extra, D3S_PRINT_ONLY="1", **env)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def split_submit(argv):
    """(ray job submit options as a dict, entrypoint argv after `--`)."""
    assert argv[:3] == ["ray", "job", "submit"], argv[:3]
    cut = argv.index("--")
    options, i = {}, 3
    while i < cut:
        if i + 1 < cut and not argv[i + 1].startswith("--"):
            options[argv[i]] = argv[i + 1]
            i += 2
        else:
            options[argv[i]] = True
            i += 1
    return options, argv[cut + 1 :]


def flags(argv):
    """``--flag v1 v2`` -> {"flag": "v1 v2"}; store_true flags -> True; the last occurrence wins."""
    parsed, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        parsed[argv[i][2:]] = " ".join(argv[i + 1 : j]) if j > i + 1 else True
        i = j
    return parsed


def entry_flags(script: Path, *extra: str, **env):
    _, entry = split_submit(printed_command(script, *extra, **env))
    assert entry[:3] == ENTRYPOINT
    return flags(entry[3:])


def d3s_config(f) -> D3SConfig:
    return D3SConfig.from_flags({k: _typed(k, v) for k, v in f.items() if k.startswith("d3s.") and k != "d3s.seed"})


def _typed(key, value):
    if key in ("d3s.n_init", "d3s.n_final"):
        return int(value)
    if key in ("d3s.k_init", "d3s.k_final"):
        return float(value)
    return value


# -- the set of scripts --------------------------------------------------------------------------------------------


def test_one_script_per_model_and_setting():
    found = {}
    for path in ALL_SCRIPTS:
        found.setdefault(path.parent.name, set()).add(path.stem)
    assert found == EXPECTED
    assert len(ALL_SCRIPTS) == 22


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=SCRIPT_IDS)
def test_script_is_small_and_documented(script):
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for header in ("# Setting:", "# Paper reports:", "# Hardware assumed:", "# Chosen by us:"):
        assert header in text, header
    code = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert code == [
        "set -euo pipefail",
        f"MODEL_PROFILE={script.parent.name}",
        f"SETTING={script.stem}",
        'source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"',
        'd3s_launch "$@"',
    ]


# -- the submit command ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=SCRIPT_IDS)
def test_submit_command(script):
    argv = printed_command(script, "--logger.wandb.run_name", "with space")
    options, entry = split_submit(argv)
    assert options["--address"] == "http://127.0.0.1:8265"
    runtime_env = json.loads(options["--runtime-env-json"])
    assert runtime_env["working_dir"] == str(ROOT)
    assert {".git/", ".venv/"} <= set(runtime_env["excludes"])
    assert runtime_env["env_vars"] == {}
    assert entry[:3] == ENTRYPOINT
    assert entry[-2:] == ["--logger.wandb.run_name", "with space"]  # "$@" passes through, quoting intact

    f = flags(entry[3:])
    profile, setting = script.parent.name, script.stem
    assert f["actor.model_name_or_path"] == MODELS[profile]
    assert (ROOT / f["reward.remote_url"]).resolve() == ROOT / "d3s_openrlhf" / "rewards" / "math_reward.py"
    assert (f["data.input_key"], f["data.label_key"], f["data.apply_chat_template"]) == ("prompt", "label", True)
    data = "gsm8k" if profile == "qwen2.5-3b-instruct" else "math"
    assert f["data.prompt_dataset"] == f"data/train_{data}.jsonl" and f["eval.dataset"] == f"data/eval_{data}.jsonl"
    if profile == "qwen2.5-3b-instruct":  # PODS's published setting: LoRA on one GPU, n = 64
        assert (f["ds.lora.rank"], f["actor.num_gpus_per_node"], f["rollout.n_samples_per_prompt"]) == ("64", "1", "64")
    else:
        assert "ds.lora.rank" not in f
    assert f["algo.advantage.estimator"] == "group_norm"
    assert f["actor.policy_loss_type"] == ("gspo" if setting.startswith("gspo") else "ppo")
    gpus = int(f["actor.num_nodes"]) * int(f["actor.num_gpus_per_node"])
    assert int(f["vllm.num_engines"]) * int(f["vllm.tensor_parallel_size"]) == gpus  # colocate_all
    assert int(f["ref.num_nodes"]) * int(f["ref.num_gpus_per_node"]) == gpus


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=SCRIPT_IDS)
def test_batch_sizes_keep_the_d3s_invariant_at_every_schedule_point(script):
    f = entry_flags(script)
    prompts, group = int(f["rollout.batch_size"]), int(f["rollout.n_samples_per_prompt"])
    dp = int(f["actor.num_nodes"]) * int(f["actor.num_gpus_per_node"])  # no ring attention / DeepSpeed TP
    assert "ds.ring_attn_size" not in f and "ds.tensor_parallel_size" not in f
    assert "train.dynamic_batch_enable" not in f
    unit = math.lcm(int(f["train.batch_size"]), int(f["rollout.micro_batch_size"]) * dp)
    assert (prompts * group) % unit == 0
    config = d3s_config(f)
    assert config.preset == PRESETS[script.stem]
    if config.samples_enabled:
        assert group >= config.max_n
        low, high = sorted((config.n_init, config.max_n))
        assert all((n * prompts) % unit == 0 for n in range(low, high + 1))  # no rounding of any N


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=SCRIPT_IDS)
def test_settings_match_the_papers(script):
    config = d3s_config(entry_flags(script))
    setting, profile = script.stem, script.parent.name
    if setting == "grpo":
        assert not config.enabled
        return
    if "d3s" in setting:
        assert (config.n_init, config.n_final, config.k_init, config.k_final) == (8, 32, 0.05, 0.2)
        assert config.schedule == "linear" and config.advantage_mode == "group" and config.sample_rule == "max_var"
        assert config.sample_scope == ("intra" if setting.endswith("_i") else "cross")
    elif setting == "grpo_pods":
        assert (config.sample_scope, config.advantage_mode, config.n_init, config.schedule) == (
            "intra",
            "subset",
            16,
            "constant",
        )
        assert not config.tokens_enabled
    elif setting == "grpo_d1s":
        assert (config.sample_scope, config.n_init, config.schedule, config.tokens_enabled) == (
            "intra",
            20,
            "constant",
            False,
        )
    elif setting == "grpo_d2s":
        assert (config.sample_scope, config.n_init, config.k_init, config.schedule) == ("cross", 20, 0.125, "constant")
    if profile.startswith("llama") and setting != "grpo_d3s" and "d3s" in setting:
        assert config.sample_scope == "intra"  # the paper's stable choice for Llama3.1-8B-Instruct


# -- environment overrides ----------------------------------------------------------------------------------------


def test_environment_overrides():
    script = SCRIPTS / "qwen2.5-math-7b" / "grpo_d3s.sh"
    argv = printed_command(
        script,
        MODEL="/models/q7",
        DATA="/data/train.jsonl",
        EVAL_DATA="",
        RAY_ADDRESS="http://head:8265",
        RAY_SUBMIT_ARGS="--no-wait",
        N_SAMPLES="64",
        CKPT_ROOT="/ckpt",
        D3S_REWARD_FORMAT_WEIGHT="0.1",
    )
    options, entry = split_submit(argv)
    assert options["--address"] == "http://head:8265" and options["--no-wait"] is True
    assert json.loads(options["--runtime-env-json"])["env_vars"] == {"D3S_REWARD_FORMAT_WEIGHT": "0.1"}
    f = flags(entry[3:])
    assert f["actor.model_name_or_path"] == "/models/q7" and f["data.prompt_dataset"] == "/data/train.jsonl"
    assert f["rollout.n_samples_per_prompt"] == "64"
    assert f["ckpt.output_dir"] == "/ckpt/qwen2.5-math-7b_grpo_d3s"
    assert not any(key.startswith("eval.") for key in f)  # EVAL_DATA= turns evaluation off


def test_launcher_override_and_custom_runtime_env():
    script = SCRIPTS / "llama3.1-8b-instruct" / "grpo.sh"
    argv = printed_command(script, D3S_LAUNCH="python -m d3s_openrlhf.cli.train_ppo_ray")
    assert argv[:3] == ["python", "-m", "d3s_openrlhf.cli.train_ppo_ray"] and "ray" not in argv
    options, _ = split_submit(printed_command(script, RUNTIME_ENV_JSON='{"pip": ["x"]}'))
    assert json.loads(options["--runtime-env-json"]) == {"pip": ["x"]}


def test_installed_mode_uses_the_installed_reward_and_absolute_paths(tmp_path):
    script = SCRIPTS / "qwen2.5-math-1.5b" / "grpo_pods.sh"
    argv = printed_command(script, cwd=tmp_path, D3S_SHIP="installed", PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    options, entry = split_submit(argv)
    assert "working_dir" not in json.loads(options["--runtime-env-json"])
    f = flags(entry[3:])
    assert Path(f["reward.remote_url"]) == ROOT / "d3s_openrlhf" / "rewards" / "math_reward.py"
    assert f["data.prompt_dataset"] == str(tmp_path / "data" / "train_math.jsonl")


def test_unknown_ship_mode_fails():
    done = run_script(SCRIPTS / "qwen2.5-math-7b" / "grpo.sh", D3S_PRINT_ONLY="1", D3S_SHIP="scp")
    assert done.returncode != 0 and "D3S_SHIP" in done.stderr


# -- through the real entrypoint -----------------------------------------------------------------------------------


def test_host_flags_parse_with_upstreams_parser():
    """Every script's OpenRLHF flags go through OpenRLHF 0.11.2's own parser (also for the GRPO baselines)."""
    from d3s_openrlhf.integration.host import parse_host_args, split_d3s_flags

    for script in ALL_SCRIPTS:
        _, entry = split_submit(printed_command(script))
        given, host_argv = split_d3s_flags(entry[3:])
        args = parse_host_args(host_argv)
        pods_lora = script.parent.name == "qwen2.5-3b-instruct"  # PODS's n = 64 rollouts of 8 prompts, LoRA
        assert (args.rollout.n_samples_per_prompt, args.rollout.batch_size) == ((64, 8) if pods_lora else (32, 128))
        assert args.ds.lora.rank == (64 if pods_lora else 0), script
        assert args.reward.remote_url == "d3s_openrlhf/rewards/math_reward.py", script
        assert given["d3s.preset"] == PRESETS[script.stem], script


def _dry_run(script, *extra, **env):
    return run_script(
        script, *extra, "--d3s.dry_run", D3S_LAUNCH=f"{sys.executable} -m d3s_openrlhf.cli.train_ppo_ray", **env
    )


def dry_run_lines(script, capsys, *extra):
    """The dry run's printed lines for the script's own entrypoint argv (``extra`` appended), validated in this
    process (a Python start-up per script would cost minutes); test_dry_run_rejects_broken_batch_sizes runs the
    whole launch through bash."""
    from d3s_openrlhf.cli.train_ppo_ray import main

    _, entry = split_submit(printed_command(script, *extra))
    assert entry[:3] == ENTRYPOINT
    capsys.readouterr()
    main([*entry[3:], "--d3s.dry_run"])
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=SCRIPT_IDS)
def test_dry_run_accepts_every_script(script, capsys):
    lines = dry_run_lines(script, capsys)
    assert f"--d3s.preset {PRESETS[script.stem]}" in lines
    assert "--d3s.dry_run True" in lines


@pytest.mark.parametrize(
    "overrides, complaint",
    [
        ({"N_SAMPLES": "16"}, "max(N)"),  # G below the schedule's N_final = 32
        ({"TRAIN_BATCH": "96"}, "not a multiple"),  # 4096 rollouts do not split into lcm(96, 64) = 192
    ],
)
def test_dry_run_rejects_broken_batch_sizes(overrides, complaint):
    done = _dry_run(SCRIPTS / "qwen2.5-math-7b" / "grpo_d3s.sh", **overrides)
    assert done.returncode != 0
    assert complaint in done.stderr


def test_the_generation_levels_example_passes_the_dry_run(capsys):
    """docs/generation.md's command (history skipping appended to a launch script) as the docs print it."""
    docs = (ROOT / "docs" / "generation.md").read_text()
    [command] = [line for line in docs.splitlines() if line.startswith("bash examples/scripts/")]
    script, *appended = shlex.split(command)[1:]
    lines = dry_run_lines(ROOT / script, capsys, *appended)
    assert {"--d3s.prompt_skip history", "--d3s.schedule_steps 175"} <= set(lines)
