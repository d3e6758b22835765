"""The toy job's building blocks, shared by the demo (``d3s_openrlhf.cli.demo``) and the end-to-end tests.

Each OpenRLHF stage runs as its own process under the CPU launcher (``python -m d3s_openrlhf.cli.cpu
<module> ...``), so every stage starts and stops its own Ray head and exits like a user's command would.
"""

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field, fields

from d3s_openrlhf import tasks
from d3s_openrlhf.testbed import toy

REWARD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "addition_reward.py")
D3S_ENTRYPOINT = "d3s_openrlhf.cli.train_ppo_ray"


def launcher_command(module, args, fp32=False):
    """The CPU launcher's command for ``module``; ``fp32``: every model in float32 (its ``--fp32``)."""
    return [sys.executable, "-m", "d3s_openrlhf.cli.cpu", *(["--fp32"] if fp32 else []), module, *map(str, args)]


def run_logged(command, log_path, on_line=None, env=None, timeout=None):
    """Run ``command``, appending its output to ``log_path`` and passing each line to ``on_line``; returns rc.

    After ``timeout`` seconds (raises ``TimeoutError``) or on Ctrl-C the process group is interrupted, then
    terminated (the launcher stops its Ray head on the interrupt).
    """
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def expire():
            timed_out.set()
            _terminate(process)

        watchdog = threading.Timer(timeout, expire) if timeout else None
        try:
            if watchdog is not None:
                watchdog.start()
            for line in process.stdout:
                log.write(line)
                if on_line is not None:
                    on_line(line)
            rc = process.wait()
        except BaseException:
            _terminate(process)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
    if timed_out.is_set():
        raise TimeoutError(f"{' '.join(command[:5])} ... ran past {timeout}s; see {log_path}")
    return rc


def _terminate(process):
    import signal

    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


@dataclass(frozen=True)
class TaskConfig:
    """A task (a module of :mod:`d3s_openrlhf.tasks`, by import path or file path) and its SFT warm start.

    The defaults are the built-in addition task's; :func:`task_config` applies a task module's own
    ``TASK_CONFIG`` dict of these fields."""

    task: str = tasks.DEFAULT_TASK
    n_sft: int = 420
    n_prompts: int = 400
    n_heldout: int = 80
    sft_epochs: int = 18
    sft_lr: float = 1e-3
    sft_batch_size: int = 16
    seed: int = 0


def task_config(task=tasks.DEFAULT_TASK, **overrides):
    """``TaskConfig`` for ``task``: the defaults, then the module's ``TASK_CONFIG``, then ``overrides``."""
    own = getattr(tasks.load_task(task), "TASK_CONFIG", {})
    known = {f.name for f in fields(TaskConfig)} - {"task"}
    if set(own) - known:
        raise ValueError(f"{task}: TASK_CONFIG keys {sorted(set(own) - known)} are not among {sorted(known)}")
    return TaskConfig(task=task, **{**own, **overrides})


@dataclass(frozen=True)
class TaskFiles:
    """The task's splits as OpenRLHF JSONL files."""

    sft: str  # {"input", "output"}: the SFT warm start's data
    prompts: str  # {"input", "label"}: the RL prompts
    heldout: str  # {"input", "label"}: the held-out evaluation


@dataclass(frozen=True)
class Prepared:
    base_model: str
    sft_model: str
    task: TaskFiles
    reward_file: str = REWARD_FILE  # the task's reward file for --reward.remote_url
    max_new_tokens: int = 4  # the task's MAX_NEW_TOKENS, else the longest SFT response + EOS
    max_len: int = 16  # prompt + response tokens (--data.max_len)


def sft_args(base_model, data, output_dir, config, max_len=32):
    return [
        *("--model.model_name_or_path", base_model),
        *("--data.dataset", data),
        *("--data.input_key", "input"),
        *("--data.output_key", "output"),
        *("--data.input_template", "{}"),
        *("--data.max_len", max_len),
        *("--train.batch_size", config.sft_batch_size),
        *("--train.micro_batch_size", config.sft_batch_size),
        *("--train.max_epochs", config.sft_epochs),
        *("--train.seed", config.seed),
        *("--ds.zero_stage", 0),
        *("--ds.attn_implementation", "eager"),
        *("--adam.lr", config.sft_lr),
        *("--lr_warmup_ratio", 0.02),
        *("--min_lr_ratio", 0.5),
        *("--ckpt.output_dir", output_dir),
        *("--ckpt.path", os.path.join(output_dir, "_ckpt")),
    ]


def write_task_files(directory, config):
    """The task's splits as OpenRLHF JSONL files, and the sizes the model and the runs need.

    Returns ``(TaskFiles, characters, max_new_tokens, max_len)``: the characters of every example, sorted, or
    the module's ``CHARACTERS`` (the tokenizer's vocabulary), the response budget (the module's
    ``MAX_NEW_TOKENS``, else the longest SFT response plus EOS) and prompt + response tokens (BOS and EOS
    included)."""
    task = tasks.load_task(config.task)
    os.makedirs(directory, exist_ok=True)
    splits = {
        split: tasks.examples(task, split, n, config.seed)
        for split, n in (("sft", config.n_sft), ("rl", config.n_prompts), ("heldout", config.n_heldout))
    }
    # SFT and RL on the same prompts is ordinary practice; a held-out prompt seen in training is leakage: dropped
    trained = {row["prompt"] for split in ("sft", "rl") for row in splits[split]}
    leaked = [row for row in splits["heldout"] if row["prompt"] in trained]
    if leaked:
        splits["heldout"] = [row for row in splits["heldout"] if row["prompt"] not in trained]
        print(
            f"[d3s task] {config.task}: dropped {len(leaked)} of {config.n_heldout} held-out prompts that also appear "
            f"in the sft or rl split (e.g. {leaked[0]['prompt']!r}); {len(splits['heldout'])} are evaluated",
            file=sys.stderr,
        )
        if not splits["heldout"] and config.n_heldout:
            raise ValueError(f"{config.task}: every held-out prompt also appears in the sft or rl split")
    rows = [row for split in splits.values() for row in split]
    characters = sorted({ch for row in rows for key in ("prompt", "sft_response") for ch in row[key]})
    if hasattr(task, "CHARACTERS"):  # the task's own vocabulary order (the addition task: the historical one)
        unknown = set(characters) - set(task.CHARACTERS)
        if unknown:
            raise ValueError(f"{config.task}: examples use characters {sorted(unknown)} missing from its CHARACTERS")
        characters = list(task.CHARACTERS)
    longest = max((len(row["sft_response"]) for row in splits["sft"]), default=0) + 1
    max_new_tokens = getattr(task, "MAX_NEW_TOKENS", longest)
    max_len = max(len(row["prompt"]) for row in rows) + 1 + max(max_new_tokens, longest)
    files = TaskFiles(
        sft=toy.write_jsonl(
            os.path.join(directory, "sft.jsonl"),
            [{"input": row["prompt"], "output": row["sft_response"]} for row in splits["sft"]],
        ),
        prompts=toy.write_jsonl(
            os.path.join(directory, "prompts.jsonl"),
            [{"input": row["prompt"], "label": row["answer"]} for row in splits["rl"]],
        ),
        heldout=toy.write_jsonl(
            os.path.join(directory, "heldout.jsonl"),
            [{"input": row["prompt"], "label": row["answer"]} for row in splits["heldout"]],
        ),
    )
    return files, characters, max_new_tokens, max_len


def prepare(workdir, config=TaskConfig(), log_path=None, on_line=None, fp32=False):
    """Task files, tokenizer, model and reward file in ``workdir``, then the SFT warm start
    (``openrlhf.cli.train_sft``; ``fp32``: in float32, the launcher's ``--fp32``)."""
    files, characters, max_new_tokens, max_len = write_task_files(os.path.join(workdir, "data"), config)
    shape = toy.ModelShape(max_positions=max(64, 1 << (max_len - 1).bit_length()))
    base = toy.save_model_and_tokenizer(
        os.path.join(workdir, "base_model"), shape, seed=config.seed, characters=characters
    )
    reward_file = tasks.write_reward_file(config.task, os.path.join(workdir, "reward.py"))
    sft = os.path.join(workdir, "sft_model")
    log_path = log_path or os.path.join(workdir, "logs", "sft.log")
    command = launcher_command(
        "openrlhf.cli.train_sft", sft_args(base, files.sft, sft, config, max_len=max(32, max_len)), fp32=fp32
    )
    rc = run_logged(command, log_path, on_line=on_line)
    if rc != 0:
        raise RuntimeError(f"SFT failed (exit {rc}); see {log_path}")
    return Prepared(
        base_model=base,
        sft_model=sft,
        task=files,
        reward_file=reward_file,
        max_new_tokens=max_new_tokens,
        max_len=max_len,
    )


@dataclass
class RLConfig:
    """One GRPO run on the toy task through ``train_ppo_ray`` (the D3S entrypoint by default)."""

    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    steps: int = 4  # per episode
    episodes: int = 1  # passes over the same prompts
    train_batch_size: int = 16
    micro_batch_size: int = 16
    lr: float = 2e-4
    estimator: str = "group_norm"
    kl_coef: float = 0.0  # --algo.kl.init_coef; > 0 adds the reference model's forward
    max_new_tokens: int = 4
    max_len: int = 16  # --data.max_len: prompt + response tokens
    reward: str = REWARD_FILE  # a reward_func file for --reward.remote_url
    seed: int = 42  # --train.seed (OpenRLHF's default): data order, vLLM sampling, initialisation
    actor_gpus: int = 1
    zero_stage: int = 2
    fp32: bool = False  # the launcher's --fp32: every model in float32 instead of --ds.param_dtype
    extra: list = field(default_factory=list)  # more flags, e.g. --d3s.* or --train.async_enable


# The demo's RL run (``python -m d3s_openrlhf.cli.demo``): the speed study's protocol on its chainsum task, one pass
# over fresh prompts, each algorithm at the learning rate the study chose for it (benchmarks/RESULTS.md section 1,
# 2026-11-27/28: held-out greedy 0.434 -> 0.959 for D3S, 0.961 for GRPO, over 4 seeds each).
DEMO_TASK = "d3s_openrlhf.tasks.chainsum"
DEMO_PROMPTS_PER_STEP = 8
DEMO_D3S_FLAGS = [
    *("--d3s.preset", "d3s"),
    *("--d3s.n_init", 4),
    *("--d3s.n_final", 12),
    *("--d3s.k_init", 0.2),
    *("--d3s.k_final", 0.5),
]
DEMO_LR = {"D3S": 5e-5, "GRPO": 2.5e-5}


def demo_rl_config(task_config, episodes, d3s=True, prepared=None):
    """GRPO (+ D3S: N 4 -> 12 of 16 rollouts per prompt, K 20% -> 50% of tokens), 8 prompts x 16 rollouts a step
    at the rate of :data:`DEMO_LR`, in float32 (the study's precision); with ``prepared``, the task's reward file and
    response budget (else the addition task's)."""
    task_sizes = {}
    if prepared is not None:
        task_sizes = dict(
            reward=prepared.reward_file,
            max_new_tokens=prepared.max_new_tokens,
            max_len=max(RLConfig.max_len, prepared.max_len),
        )
    return RLConfig(
        prompts_per_step=DEMO_PROMPTS_PER_STEP,
        samples_per_prompt=16,
        steps=task_config.n_prompts // DEMO_PROMPTS_PER_STEP,
        episodes=episodes,
        train_batch_size=32,
        micro_batch_size=32,
        lr=DEMO_LR["D3S" if d3s else "GRPO"],
        fp32=True,
        extra=DEMO_D3S_FLAGS if d3s else [],
        **task_sizes,
    )


def ppo_args(model, task, out_dir, config):
    return [
        *("--actor.model_name_or_path", model),
        *("--reward.remote_url", config.reward),
        *("--data.prompt_dataset", task.prompts),
        *("--data.input_key", "input"),
        *("--data.label_key", "label"),
        *("--data.max_samples", config.prompts_per_step * config.steps),
        *("--train.num_episodes", config.episodes),
        *("--train.seed", config.seed),
        *("--data.max_len", config.max_len),
        *("--rollout.max_new_tokens", config.max_new_tokens),
        *("--rollout.batch_size", config.prompts_per_step),
        *("--rollout.n_samples_per_prompt", config.samples_per_prompt),
        *("--rollout.micro_batch_size", config.micro_batch_size),
        *("--train.batch_size", config.train_batch_size),
        *("--train.micro_batch_size", config.micro_batch_size),
        *("--algo.advantage.estimator", config.estimator),
        *("--algo.kl.init_coef", config.kl_coef),
        *("--actor.num_nodes", 1),
        *("--actor.num_gpus_per_node", config.actor_gpus),
        *("--ref.num_gpus_per_node", config.actor_gpus),  # upstream's default (8) would wait forever for GPUs
        *("--actor.adam.lr", config.lr),
        *("--actor.lr_warmup_ratio", 0),
        *("--vllm.num_engines", 1),
        *("--vllm.sync_backend", "gloo"),
        "--vllm.enforce_eager",
        *("--ds.zero_stage", config.zero_stage),
        *("--ds.attn_implementation", "eager"),
        *("--logger.tensorboard_dir", os.path.join(out_dir, "tensorboard")),
        *("--ckpt.output_dir", os.path.join(out_dir, "final_model")),
        *("--ckpt.path", os.path.join(out_dir, "checkpoints")),
        *config.extra,
    ]
