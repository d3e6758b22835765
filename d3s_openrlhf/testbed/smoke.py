"""CPU smoke run of a launch script: ``examples/scripts/<model>/<setting>.sh`` for two steps on this machine.

    python -m d3s_openrlhf.cli.smoke_script examples/scripts/qwen2.5-math-1.5b/grpo_d3s.sh [--nodes 2]
    python -m d3s_openrlhf.cli.smoke_script --all

The script runs as written (its own ``ray job submit``, runtime env and working_dir upload of the checkout), with
only the toy model, data and sizes swapped in through the environment variables common.sh reads
(:func:`swapped_env`), plus ``--data.max_samples`` so that the run is exactly :data:`STEPS` steps and
``--vllm.enforce_eager`` (:func:`extra_args`). Every other flag -- colocation, ZeRO stage, loss, ``--d3s.*`` -- is
the script's. The job runs under the CPU runtime
(:mod:`d3s_openrlhf.cpu.runtime`): the script's runtime env gets ``D3S_OPENRLHF_CPU=1`` (through common.sh's
``D3S_RUNTIME_ENV_VARS``), so the job's driver activates the runtime against the cluster and gives its workers
the CUDA -> CPU adjustments; ``RAY_OVERRIDE_JOB_RUNTIME_ENV=1`` lets the driver's runtime env add to the job's
(Ray refuses to merge the two otherwise).

Each run gets a fresh Ray cluster on 127.0.0.1 (``ray_cluster``), stopped by PID when the run ends, fails or times
out; the toy model and data come from ``smoke_inputs``; the command line is ``cli/smoke_script.py``.
"""

import glob
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from d3s_openrlhf.testbed import pipeline
from d3s_openrlhf.testbed.metrics import read_train_scalars
from d3s_openrlhf.testbed.ray_cluster import Cluster

SCRIPTS_DIR = os.path.join("examples", "scripts")  # under the checkout the command runs in
STEPS = 2
# Toy sizes, the same for any --nodes and --gpus-per-node. G = 32 keeps the scripts' D3S schedule (N 8 -> 32)
# legal; 2 prompts x 32 rollouts = 64 a step, split into kept counts that are multiples of lcm(TRAIN_BATCH 16,
# ROLLOUT_MICRO_BATCH 8 x forward ranks) (integration.host.kept_count_unit): 16 up to 2 ranks, 64 at 8.
PROMPTS_PER_STEP = 2


def swapped_env(toy_files, ckpt_root, nodes, gpus_per_node):
    """The common.sh variables this tool sets (everything else comes from the script)."""
    return {
        "MODEL": toy_files.model,
        "DATA": toy_files.train,
        "EVAL_DATA": toy_files.eval,
        "REWARD_FUNC": pipeline.REWARD_FILE,
        "CKPT_ROOT": ckpt_root,
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(gpus_per_node),
        "N_SAMPLES": "32",
        "ROLLOUT_BATCH": str(PROMPTS_PER_STEP),
        "TRAIN_BATCH": "16",
        "TRAIN_MICRO_BATCH": "8",
        "ROLLOUT_MICRO_BATCH": "8",
        "NUM_EPISODES": "1",
        "MAX_LEN": "16",
        "MAX_NEW_TOKENS": "4",
        "EVAL_STEPS": str(STEPS),  # evaluation and a checkpoint once, at the last step
        "SAVE_STEPS": str(STEPS),
    }


def extra_args():
    """Flags appended to the script's command line (its last occurrence wins): the run's length, and vLLM without
    its torch.compile of the model, which costs each engine about a minute of start-up on 2 cores (a GPU run pays
    it once) and tests nothing of the script."""
    return ["--data.max_samples", str(PROMPTS_PER_STEP * STEPS), "--vllm.enforce_eager"]


@dataclass
class Result:
    script: str
    returncode: object  # int, or a text when the run was stopped after the timeout
    log: str
    steps: dict  # {global_step: {metric: value}} as OpenRLHF logged them
    leftovers: list  # cluster processes that survived SIGKILL
    seconds: float

    @property
    def ok(self):
        return (
            self.returncode == 0
            and not self.leftovers
            and list(self.steps) == list(range(1, STEPS + 1))
            and all(math.isfinite(values.get("policy_loss", math.nan)) for values in self.steps.values())
        )

    def summary(self):
        losses = ", ".join(f"{values.get('policy_loss', math.nan):.4g}" for values in self.steps.values())
        state = "ok" if self.ok else f"FAILED (exit {self.returncode}, leftovers {self.leftovers})"
        steps = f"steps {list(self.steps)}  policy_loss [{losses}]"
        return f"{state}  {self.script}  {steps}  {self.seconds:.0f}s  log {self.log}"


def script_name(script):
    return f"{os.path.basename(os.path.dirname(script))}/{os.path.splitext(os.path.basename(script))[0]}"


def script_env(script_vars, runtime_env_vars, extra_env=None):
    """The environment the script runs in: the caller's without common.sh's variables, then ``script_vars``."""
    env = {key: value for key, value in os.environ.items() if key not in COMMON_VARS}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    env.update(script_vars)
    env["D3S_RUNTIME_ENV_VARS"] = json.dumps(runtime_env_vars)
    env.update(extra_env or {})
    return env


# Variables common.sh reads; the caller's values are dropped so that only the script and SWAPPED decide.
COMMON_VARS = frozenset(
    "MODEL DATA EVAL_DATA RAY_ADDRESS NNODES GPUS_PER_NODE ZERO_STAGE TRAIN_MICRO_BATCH ROLLOUT_MICRO_BATCH "
    "CKPT_ROOT RUN_NAME N_SAMPLES ROLLOUT_BATCH TRAIN_BATCH NUM_EPISODES LR KL_COEF SEED MAX_LEN MAX_NEW_TOKENS "
    "EVAL_STEPS SAVE_STEPS VLLM_GPU_UTIL REWARD_FUNC RUNTIME_ENV_JSON RAY_SUBMIT_ARGS D3S_SHIP D3S_LAUNCH "
    "D3S_PRINT_ONLY D3S_RUNTIME_ENV_VARS PYTHON LORA_RANK LORA_ALPHA".split()
)
# What the job's runtime env gets on top of the script's: the CPU runtime's switch, and Ray's permission to
# merge the driver's runtime env (the runtime's setup hook and worker variables) into the job's.
CPU_RUNTIME_ENV_VARS = {"D3S_OPENRLHF_CPU": "1", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}


def checkout_of(script):
    """The checkout a launch script belongs to (``<checkout>/examples/scripts/<model>/<setting>.sh``): what
    common.sh ships to the job as its working_dir."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(script)))))


def dry_run(script, env):
    """The script's command line through the entrypoint's validation (``--d3s.dry_run``), without Ray, with the
    script's own checkout first on the path (the code its job will run)."""
    env = dict(env, D3S_LAUNCH=f"{sys.executable} -m d3s_openrlhf.cli.train_ppo_ray", PYTHONPATH=checkout_of(script))
    done = subprocess.run(
        ["bash", script, *extra_args(), "--d3s.dry_run"], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"{script_name(script)}: the toy sizes fail the dry run:\n{done.stderr[-3000:]}")
    return done.stdout


def run_script(script, toy_files, outdir, nodes=1, gpus_per_node=1, timeout=600, on_line=None, extra=()):
    """Run ``script`` for :data:`STEPS` steps on a fresh local cluster; returns a :class:`Result`."""
    name = script_name(script)
    run_dir = os.path.join(outdir, name.replace("/", "__") + f"__{nodes}n")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    log_path = os.path.join(run_dir, "run.log")
    script_vars = swapped_env(toy_files, os.path.join(run_dir, "ckpt"), nodes, gpus_per_node)
    env = script_env(script_vars, CPU_RUNTIME_ENV_VARS)
    with open(log_path, "a") as log:
        log.write(dry_run(script, env))
    start = time.time()
    with (
        open(log_path, "a") as log,
        Cluster(nodes=nodes, gpus_per_node=gpus_per_node, log=log, checkout=checkout_of(script)) as cluster,
    ):
        env["RAY_ADDRESS"] = cluster.dashboard_address
        command = ["bash", script, *extra_args(), *extra]
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        try:
            rc = pipeline.run_logged(command, log_path, on_line=on_line, env=env, timeout=timeout)
        except TimeoutError:
            rc = f"none: stopped after {timeout}s"
    if cluster.killed:
        with open(log_path, "a") as log:
            log.write(f"cluster processes killed after the SIGTERM grace period: {cluster.killed}\n")
    leftovers = cluster.leftovers
    # common.sh's RUN_NAME: <model profile>_<setting>
    tensorboard = os.path.join(script_vars["CKPT_ROOT"], name.replace("/", "_"), "tensorboard")
    return Result(name, rc, log_path, read_train_scalars(tensorboard), leftovers, time.time() - start)


def all_scripts(scripts_dir=SCRIPTS_DIR):
    """Every launch script ``<scripts_dir>/<model>/<setting>.sh``."""
    return sorted(glob.glob(os.path.join(scripts_dir, "*", "*.sh")))
