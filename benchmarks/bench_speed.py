"""The speed study: time to fixed held-out accuracies, each arm at its own tuned learning rate, as curves against
steps, wall time and generated tokens, over several seeds and two tasks.

Run from the repository root. One command runs the learning-rate sweep, then the study; each run is appended to
OUT/NAME.json (``--name``, speed_study) as it ends and the runs already there are skipped, so running the same
command again resumes a stopped invocation (a run cut off midway starts over):

    .venv/bin/python benchmarks/bench_speed.py [--out benchmarks/results] [--name speed_study]
        [--tasks d3s_openrlhf.tasks.chainsum d3s_openrlhf.tasks.chainsum_tens] [--regimes passes fresh]
        [--arms GRPO GRPO+DF PODS D3S D3S-I] [--lrs 2.5e-5 5e-5 1e-4 2e-4] [--sweep-seeds 0 1] [--seeds 2 3]
        [--phases sweep study rerun fixed-rate] [--rerun-seeds 0 1 2 3] [--fixed-lr LR]
        [--eval-early EVERY UNTIL] [--micro-batch 32]
    # the equal-updates study (RESULTS.md section 9; --micro-batch 8: see below): every arm at GRPO's rate, then
    # three at their own (a run at a rate the fixed-rate phase ran is not run again)
    .venv/bin/python benchmarks/bench_speed.py --name equal_updates --tasks d3s_openrlhf.tasks.chainsum_tens \
        --regimes fresh --phases fixed-rate --fixed-lr 2.5e-5 --seeds 4 5 6 7 --eval-early 2 20 --micro-batch 8 \
        --arms GRPO GRPO+half-batch D3S D3S+fixed-updates D3S-I+fixed-updates PODS+fixed-updates
    .venv/bin/python benchmarks/bench_speed.py --name equal_updates --tasks d3s_openrlhf.tasks.chainsum_tens \
        --regimes fresh --phases sweep study --lrs 2.5e-5 5e-5 2e-4 --sweep-seeds 0 --seeds 4 5 6 7 \
        --eval-early 2 20 --micro-batch 8 --arms GRPO D3S+fixed-updates D3S-I+fixed-updates
    # and chainsum passes at GRPO's rate there (5e-5, chosen in speed_study.json)
    .venv/bin/python benchmarks/bench_speed.py --name equal_updates --tasks d3s_openrlhf.tasks.chainsum \
        --regimes passes --phases fixed-rate --fixed-lr 5e-5 --seeds 4 5 6 --eval-early 2 20 --micro-batch 8 \
        --arms GRPO GRPO+half-batch D3S D3S+fixed-updates D3S-I+fixed-updates PODS+fixed-updates
    .venv/bin/python benchmarks/bench_speed.py --quick --out /tmp/speed_quick   # the chain, in about 2 minutes
    .venv/bin/python benchmarks/report.py   # RESULTS.md, its section of benchmarks/results/speed_study.json
    .venv/bin/python benchmarks/report.py --speed OUT/speed_study.json --output OUT/speed_study.md  # any OUT alone

The protocol (the analysis and its document: ``benchmarks/reporting/speed.py``):

- Arms (``ARMS``): GRPO, GRPO + upstream's dynamic filtering, PODS (n = 16, m = 4, max-variance), D3S and D3S-I, all
  at G = 16 rollouts per prompt, 8 prompts a step; and, named with ``--arms``, D3S + the history prior
  (``--d3s.prompt_skip history``), which acts only when prompts recur, so it ran in ``passes`` alone, in a later
  batch than the study, beside reruns of D3S (``--phases rerun``). The optimizer steps apart: GRPO takes one per 32
  trained rollouts (``--train.batch_size``), 4 per rollout step; D3S 1 -> 3, PODS 1. ``GRPO+half-batch`` takes 8
  (``--train.batch_size 16``), and ``<arm>+fixed-updates`` (PODS, D3S, D3S-I with ``--d3s.optimizer_steps
  fixed_updates``) GRPO's 4, each on kept / 4 rollouts. Fixed updates needs those to be whole micro-batches: at
  ``--micro-batch`` 32 the kept counts round up to all 128 rollouts (nothing dropped; the run's start-up note says
  so), at 8 they are D3S's own (32, 64, 96).
- ``--phases fixed-rate --fixed-lr LR``: every ``--arms`` at LR on ``--seeds``, no sweep (phase ``fixed-rate``): the
  arms as a user switches them on at GRPO's tuned rate. The equal-updates study runs it at GRPO's rate on
  chainsum_tens fresh (2.5e-5, chosen in speed_study.json on seeds 0 and 1) on seeds 4-7, which chose nothing;
  then GRPO and D3S and D3S-I with fixed updates sweep 2.5e-5, 5e-5 and 2e-4 (GRPO's at 2e-4 sets the budget) on
  seed 0 alone, and the study runs each at its chosen rate on seeds 4-7, reusing the fixed-rate runs at that rate;
  and every arm at GRPO's rate on chainsum passes (5e-5) on seeds 4-6 (no sweep there yet).
- Every run trains ``--steps`` (150) rollout steps with ``--d3s.schedule_steps`` (:func:`rl_config`), in the regimes
  ``passes`` (the first ``--pool`` 200 RL prompts, cycled: 6 passes) and ``fresh`` (one pass over a 4000-prompt
  split). Per task, its regimes among ``--regimes`` are those of ``TASKS``: chainsum in both, chainsum_tens (the
  second task, on which chainsum's early saturation should not happen) in ``fresh``.
- Held-out greedy accuracy every ``--eval-every`` (10) steps, and with ``--eval-early EVERY UNTIL`` every EVERY steps
  up to UNTIL (checkpoints then saved every EVERY steps, the others deleted unread: an early threshold is then not
  read off the first evaluation), on ``--heldout`` (256) prompts, from the checkpoints the run saves: after the run,
  in this process, with transformers' ``generate`` on the small model (no vLLM engine or Ray to start per
  checkpoint), greedy alone (``--eval-samples 0``: the study reads nothing else); the checkpoints are then deleted.
  Wall time is the sum of the steps' ``timing/step_total``: start-up, checkpoint saving and the evaluations are not
  in it. A run is kept as its curve (each evaluation with its step, wall time and generated tokens) and the totals
  of its steps' timings, generated tokens and skipped prompts: what the report reads.
- Per task, once its warm start (the task's SFT, shared by every run) is evaluated and before its first run, the
  thresholds: warm start + ``--fractions`` (25%, 50%, 75%) of the gap to 1.0, stored in the JSON and never
  recomputed. The workdir is scratch: on a fresh machine the warm start is made again, and the study goes on only if
  its weights are the recorded runs' (their digest; for a task recorded without one, only its held-out greedy
  accuracy is compared: chainsum's, made again on 2026-11-28, gave the recorded 111 of 256).
- The sweep: every arm at every ``--lrs`` (2.5e-5, 5e-5, 1e-4, 2e-4: today's 2e-4 and 8x below it; 2.5e-5 joined once
  most arms had chosen 5e-5, then the lowest rate; the committed chainsum_tens study ran ``--lrs 1.25e-5 2.5e-5 5e-5
  1e-4 2e-4``, as GRPO chose 2.5e-5 there), on the ``--sweep-seeds`` (0, 1), seed by seed. Each arm's rate is the one
  with the highest seed-mean area under its held-out curve against wall time up to the sweep's budget, GRPO's
  seed-mean total wall time at 2e-4. The study: the ``--seeds`` (2, 3) at each arm's chosen rate; the sweep's seeds at
  that rate count too, so 4 seeds. ``--phases study`` refuses to start an arm whose sweep is incomplete.
- ``--phases rerun`` times the ``--arms`` again at their chosen rates on ``--rerun-seeds``, recorded apart (phase
  ``rerun``, logs under ``WORKDIR/<task>/rerun``), once per arm and seed: the base of arms run in a later batch, timed
  in that batch (``--arms D3S --phases rerun --rerun-seeds 0 1`` before D3S + history and ``2 3`` after, 2026-11-27/28).

Cost on 2 CPU cores (measured 2026-11-27): a run with its 16 evaluations takes 2.5 to 4 minutes (chainsum; 3.3 on
average) and 3.5 to 3.7 (chainsum_tens), about 45 s of it starting Ray, the actors and vLLM; each task's SFT warm
start 5 minutes. Per task and regime, 5 arms x 4 rates x 2 seeds = 40 sweep runs and 5 x 2 = 10 study runs, about 2.8
hours; chainsum's two regimes and chainsum_tens's one make 150 runs (160 with chainsum_tens at 1.25e-5), about 8.5
hours. Leave the machine otherwise idle: the curves' clock is wall time (runs that shared the CPU with tests took
1.1-2.7x as long a step). Even idle, this VM's speed drifted between sessions: batches of runs generated 10-25% faster
or slower per token (2026-11-27), so runs added later (a new rate) carry that in their wall time; the report's steps
and generated-token ratios do not.

A run still going after ``--run-cap`` seconds (900) is stopped and kept with its logged steps and the checkpoints
it saved before its last one (``stopped`` in the JSON): GRPO + DF at 2e-4 on chainsum_tens collapsed to reward 0,
after which upstream's filter drops every group (all flat) and draws again, so a step that needs 8 groups with
variance generates for ever (2026-11-27). Such a run's last evaluation is its final accuracy (a collapse, read as
any other) and a threshold it never reached is censored at its end; the report lists the stopped runs.

``--quick`` checks the chain: a 1-epoch SFT on 64 examples, GRPO and D3S (the arms that drop flat groups would stall on
so weak a warm start), lr 2e-4, seed 0, 4 steps with an evaluation every 2 on 16 held-out prompts (``--regimes
fresh``, 2026-11-27, 2 CPU cores: 2 minutes; the SFT 21 s, each run 48 s, nearly all of it starting Ray, the actors
and vLLM); its report says it is a smoke test. One ``--out`` holds one protocol: a run with other settings is refused.
GRPO runs as ``--d3s.preset d1s`` with N = G (nothing dropped: upstream's batch path, the same update as D3S off), so
that it goes through the same code as the other arms.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

from bench_selection import cpu_model
from d3s_openrlhf.testbed import evaluate, pipeline
from d3s_openrlhf.testbed.metrics import read_train_scalars
from reporting.speed import FIXED_RATE, REFERENCE_LR, regime_analysis, thresholds

HERE = Path(__file__).resolve().parent
PROMPTS = 8  # prompts per step
G = 16  # generated rollouts per prompt
PODS_M = 4  # PODS trains m = 4 of its n = G (the paper's n = 4m; its GSM8K setting is m = 16, n = 64)


def _d3s(preset, n_init, n_final=None, *more):
    return ["--d3s.preset", preset, "--d3s.n_init", n_init, "--d3s.n_final", n_final or n_init, *more]


DYNAMIC_FILTERING = "--algo.dynamic_filtering_enable"  # upstream's range (0, 1): drops flat 0/1 groups
HISTORY = ["--d3s.prompt_skip", "history"]
FIXED_UPDATES = ["--d3s.optimizer_steps", "fixed_updates"]  # every step takes GRPO's optimizer steps
HALF_BATCH = ["--train.batch_size", 16]  # half the optimizer batch (32, pipeline.demo_rl_config): twice the updates
_SCHEDULE = ["--d3s.k_init", 0.2, "--d3s.k_final", 0.5]  # D3S's K, scaled to our 20-44 token responses
# arm -> (generated rollouts per prompt, --d3s.* and upstream flags)
ARMS = {
    "GRPO": (G, _d3s("d1s", G)),
    "GRPO+DF": (G, [*_d3s("d1s", G), DYNAMIC_FILTERING]),
    "GRPO+half-batch": (G, [*_d3s("d1s", G), *HALF_BATCH]),
    "PODS": (G, _d3s("pods", PODS_M)),
    "PODS+fixed-updates": (G, [*_d3s("pods", PODS_M), *FIXED_UPDATES]),
    "D3S": (G, _d3s("d3s", 4, 12, *_SCHEDULE)),
    "D3S+fixed-updates": (G, [*_d3s("d3s", 4, 12, *_SCHEDULE), *FIXED_UPDATES]),
    "D3S-I": (G, _d3s("d3s-i", 4, 12, *_SCHEDULE)),
    "D3S-I+fixed-updates": (G, [*_d3s("d3s-i", 4, 12, *_SCHEDULE), *FIXED_UPDATES]),
    "D3S+history": (G, [*_d3s("d3s", 4, 12, *_SCHEDULE), *HISTORY]),
}
STUDY_ARMS = ("GRPO", "GRPO+DF", "PODS", "D3S", "D3S-I")  # --arms' default
QUICK_ARMS = ("GRPO", "D3S")  # the quick warm start solves almost nothing: the arms that drop flat groups would stall
REGIMES = ("passes", "fresh")
TASKS = {"d3s_openrlhf.tasks.chainsum": REGIMES, "d3s_openrlhf.tasks.chainsum_tens": ("fresh",)}  # task -> regimes
STEPS = 150
PASSES_PROMPTS = 200  # the passes regime's RL prompts, cycled (6 passes at 150 steps of 8)
FRESH_PROMPTS = 4000  # the RL split: the fresh regime draws from it without cycling
LRS = (2.5e-5, 5e-5, 1e-4, REFERENCE_LR)
SWEEP_SEEDS, STUDY_SEEDS = (0, 1), (2, 3)
EVAL_EVERY, HELDOUT = 10, 256
MICRO_BATCH = 32  # training and rollout micro-batch (pipeline.demo_rl_config's)
FRACTIONS = (0.25, 0.5, 0.75)  # thresholds: warm start + these shares of the gap to 1.0
SUMMED = (  # a run's totals over its steps, as the report reads them
    "timing/step_total",
    "timing/generation",
    "timing/make_experience",
    "timing/ppo_train",
    "d3s/skipped_prompts",
)
KEYS = (*SUMMED, "rollout/response_length_mean", "rollout/num_samples", "d3s/generated_tokens")  # read off the events
CHECKPOINT = re.compile(r"global_step(\d+)_hf$")
RUN_CAP = 900.0  # seconds; a run takes 2.5 to 4 minutes (2026-11-27)
PROTOCOL = (
    "precision",
    "quick",
    "steps",
    "eval_every",
    "eval_early",
    "micro_batch",
    "prompts_per_step",
    "pool",
    "heldout",
    "eval_samples",
    "fractions",
)
LEGACY_PROTOCOL = dict(eval_early=None, micro_batch=MICRO_BATCH)  # a document from before these keys ran with these


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory")
    parser.add_argument(
        "--name",
        default="speed_study",
        help="the study's name: it is OUT/NAME.json (report.py reads speed_study and equal_updates)",
    )
    parser.add_argument("--workdir", default=None, help="scratch directory (default: OUT/speed_runs)")
    parser.add_argument(
        "--tasks", nargs="+", default=None, help=f"task modules (default: {' '.join(TASKS)}; --quick: chainsum)"
    )
    parser.add_argument(
        "--regimes", nargs="+", default=list(REGIMES), choices=REGIMES, help="among each task's own (TASKS)"
    )
    parser.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), help=f"default: {STUDY_ARMS}")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS), help="the sweep's learning rates")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=list(SWEEP_SEEDS))
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=list(STUDY_SEEDS), help="the study's other seeds, at the chosen rates"
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["sweep", "study"],
        choices=("sweep", "study", "rerun", FIXED_RATE),
        help="rerun: the --arms again at their chosen rates on --rerun-seeds, kept apart (phase rerun), so that the "
        "generation level's arms, run in a later batch, are compared with GRPO and D3S timed in the same batch; "
        f"{FIXED_RATE}: every --arms at the one rate --fixed-lr on --seeds, no sweep (an arm switched on at GRPO's "
        "tuned rate, as a user who runs no sweep does)",
    )
    parser.add_argument("--fixed-lr", type=float, default=None, help=f"the rate of --phases {FIXED_RATE}")
    parser.add_argument("--rerun-seeds", type=int, nargs="+", default=[*SWEEP_SEEDS, *STUDY_SEEDS])
    parser.add_argument("--steps", type=int, default=STEPS, help="rollout steps per run")
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument(
        "--eval-early",
        type=int,
        nargs=2,
        default=None,
        metavar=("EVERY", "UNTIL"),
        help="also evaluate every EVERY steps up to step UNTIL (checkpoints saved every EVERY steps; those not "
        "evaluated are deleted), so that an early threshold is not read at the first evaluation",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=MICRO_BATCH,
        help="training and rollout micro-batch; fixed updates needs kept / U rollouts (8 at N 4 of 16) to be whole "
        "micro-batches",
    )
    parser.add_argument("--heldout", type=int, default=HELDOUT, help="held-out prompts")
    parser.add_argument("--eval-samples", type=int, default=0, help="sampled responses per held-out prompt (0: none)")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per RL step")
    parser.add_argument("--pool", type=int, default=PASSES_PROMPTS, help="the passes regime's RL prompts")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS), help="the thresholds' shares")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--quick", action="store_true", help="check the chain (see the docstring)")
    parser.add_argument(
        "--run-cap",
        type=float,
        default=RUN_CAP,
        help="seconds after which a run is stopped and kept with the evaluations it saved (a collapsed policy under "
        "dynamic filtering can generate flat groups for hours)",
    )
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.eval_every, options.heldout, options.pool = 4, 2, 16, 2 * options.prompts
        options.eval_early = None
        options.lrs, options.sweep_seeds, options.seeds, options.rerun_seeds = [REFERENCE_LR], [0], [], [0]
    options.tasks = options.tasks or (["d3s_openrlhf.tasks.chainsum"] if options.quick else list(TASKS))
    options.arms = options.arms or list(QUICK_ARMS if options.quick else STUDY_ARMS)
    if not any(math.isclose(lr, REFERENCE_LR) for lr in options.lrs):
        raise SystemExit(f"--lrs must include {REFERENCE_LR:g}: GRPO's total wall time at it is the sweep's budget")
    if set(options.seeds) & set(options.sweep_seeds):
        raise SystemExit(f"--seeds {options.seeds} and --sweep-seeds {options.sweep_seeds} must differ")
    if not all(0 < f < 1 for f in options.fractions):
        raise SystemExit(f"--fractions {options.fractions} must lie between 0 and 1")
    if "passes" in options.regimes:
        check_pool(options.pool, options.prompts, options.steps)
    if (FIXED_RATE in options.phases) != (options.fixed_lr is not None):
        raise SystemExit(f"--phases {FIXED_RATE} and --fixed-lr go together")
    if options.eval_early and not (0 < options.eval_early[0] <= options.eval_early[1]):
        raise SystemExit(f"--eval-early {options.eval_early}: EVERY must be positive and at most UNTIL")
    if options.eval_early and options.eval_every % options.eval_early[0]:
        raise SystemExit(
            f"--eval-every {options.eval_every} must be a multiple of --eval-early's EVERY {options.eval_early[0]}: "
            "checkpoints are saved every EVERY steps"
        )
    return options


def task_overrides(options):
    """The task config's sizes: a fresh split large enough never to cycle, the held-out prompts; --quick's SFT."""
    if options.quick:
        return dict(n_sft=64, sft_epochs=1, n_prompts=4 * options.steps * options.prompts, n_heldout=options.heldout)
    return dict(n_prompts=FRESH_PROMPTS, n_heldout=options.heldout)


def protocol(options):
    """The settings every run of one --out shares (``PROTOCOL``)."""
    values = dict(vars(options), prompts_per_step=options.prompts, fractions=list(options.fractions))
    values["eval_early"] = values["eval_early"] and list(values["eval_early"])
    return {key: values[key] for key in PROTOCOL}


def evaluated_steps(steps, eval_every, eval_early):
    """The steps whose checkpoints are evaluated (the final model, at ``steps``, always is): every ``eval_every``,
    and every ``eval_early[0]`` up to ``eval_early[1]``."""
    early = set(range(eval_early[0], eval_early[1] + 1, eval_early[0])) if eval_early else set()
    return sorted({step for step in range(eval_every, steps + 1, eval_every)} | early | {steps})


def check_pool(pool, prompts, steps):
    """The passes regime's pool: whole batches that divide the steps (the arms that drop no prompt train whole
    passes over it)."""
    batches = pool // prompts
    if pool % prompts or not batches or steps % batches:
        raise SystemExit(
            f"--pool {pool} must be a multiple of --prompts {prompts} whose batches ({batches}) divide --steps "
            f"{steps}: the arms that drop no prompt train whole passes over it"
        )


def drops_prompts(arm):
    """Whether the arm drops prompts before training (skipping, dynamic filtering): it then trains the fixed
    --d3s.schedule_steps, cycling over the prompts as it needs."""
    flags = ARMS[arm][1]
    return "--d3s.prompt_skip" in flags or DYNAMIC_FILTERING in flags


def rl_config(prepared, arm, seed, steps, save_every, prompts, fp32, pool, lr, micro_batch=MICRO_BATCH):
    """The run's configuration: exactly ``steps`` rollout steps with --d3s.schedule_steps ``steps`` over the first
    ``pool`` RL prompts (the passes regime's pool, or the whole RL split of the fresh one), at learning rate ``lr``:
    the arms that drop prompts by their fixed steps, cycling over the pool as often as they need, the others by
    upstream's passes (whole passes over the pool; over a pool of more than ``steps`` x ``prompts``, one pass over
    its first ones); a checkpoint every ``save_every`` steps (0: none)."""
    group, flags = ARMS[arm]
    pass_steps, episodes = pool // prompts, 1
    if not drops_prompts(arm):
        pass_steps = min(pass_steps, steps)
        episodes = steps // pass_steps
    extra = [*flags, "--d3s.schedule_steps", steps]
    if save_every:
        extra += ["--ckpt.save_steps", save_every, "--ckpt.save_hf", "--ckpt.disable_ds"]
    config = pipeline.demo_rl_config(pipeline.TaskConfig(), episodes=episodes, prepared=prepared)
    return dataclasses.replace(
        config,
        prompts_per_step=prompts,
        samples_per_prompt=group,
        steps=pass_steps,
        seed=seed,
        extra=extra,
        fp32=fp32,
        lr=lr,
        micro_batch_size=micro_batch,
    )


def run(
    prepared,
    task,
    arm,
    seed,
    workdir,
    steps,
    eval_every,
    samples,
    prompts,
    fp32,
    regime,
    pool,
    lr,
    cap,
    eval_early=None,
    micro_batch=MICRO_BATCH,
):
    """One RL run (``d3s_openrlhf.cli.train_ppo_ray`` on the CPU runtime) and its held-out evaluations at
    :func:`evaluated_steps`, its saved models deleted (its log and events stay); returns the per-step metrics
    (``KEYS``) and the evaluation curve. ``regime``: "passes" over the first ``pool`` prompts, or "fresh" ones
    (``pool``: the whole RL split). A run still going after ``cap`` seconds is stopped and kept as it is
    (``stopped``: its logged steps and the checkpoints saved before its last logged step; a policy that collapsed
    under dynamic filtering at fixed steps can spend hours generating groups that are all flat)."""
    save_every = eval_early[0] if eval_early else eval_every
    config = rl_config(prepared, arm, seed, steps, save_every, prompts, fp32, pool, lr, micro_batch)
    name = f"speed-{regime}-{arm}-lr{lr:g}-seed{seed}"
    run_dir = os.path.join(workdir, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped before: its events and checkpoints would mix in
    command = pipeline.launcher_command(
        pipeline.D3S_ENTRYPOINT, pipeline.ppo_args(prepared.sft_model, prepared.task, run_dir, config), config.fp32
    )
    log = os.path.join(workdir, f"{name}.log")
    started = time.time()
    stopped = False
    try:
        rc = pipeline.run_logged(command, log, timeout=cap)
    except TimeoutError:
        stopped, rc = True, 0
    if rc != 0:
        raise RuntimeError(f"{name} failed (exit {rc}); see {log}")
    seconds = time.time() - started
    scalars = read_train_scalars(os.path.join(run_dir, "tensorboard"))
    logged = [{"step": step, **{key: values[key] for key in KEYS if key in values}} for step, values in scalars.items()]
    models = {
        int(CHECKPOINT.search(path).group(1)): path
        for path in glob.glob(os.path.join(run_dir, "checkpoints", "global_step*_hf"))
    }
    wanted = set(evaluated_steps(steps, eval_every, eval_early))
    models = {step: path for step, path in models.items() if step in wanted}
    if stopped:  # no final model; a checkpoint of the last logged step may have been cut off while it was written
        models = {step: path for step, path in models.items() if step < len(logged)}
    else:
        models[len(logged)] = os.path.join(run_dir, "final_model")
    started_eval = time.time()
    evaluation = dict(seed=seed, task=task, max_new_tokens=prepared.max_new_tokens, samples=samples)
    curve = [
        {"step": step, **evaluate.heldout_accuracy(path, prepared.task.heldout, **evaluation)}
        for step, path in sorted(models.items())
    ]
    eval_seconds = time.time() - started_eval
    for path in ("checkpoints", "final_model"):  # every saved model: the last checkpoint too, which the final one is
        shutil.rmtree(os.path.join(run_dir, path), ignore_errors=True)
    return {
        "group": config.samples_per_prompt,
        "steps": logged,
        "heldout": curve,
        "process_seconds": seconds,
        "eval_seconds": eval_seconds,
        "stopped": stopped,
    }


def task_dir_name(task):
    """A task's import path or file as a directory name."""
    return re.sub(r"\W+", "_", task)


def prepare_task(task, precision, task_config, workdir, split):
    """The SFT warm start in ``workdir``, shared by every run with the same task, precision and ``split`` (a name
    for the task config's sizes); ``(prepared, SFT seconds or None when reused)``."""
    prepare_dir = os.path.join(workdir, f"task-{task_dir_name(task)}-{precision}{split}")
    recorded = Path(prepare_dir, "prepared.json")
    if recorded.exists():
        prepared = pipeline.Prepared(**json.loads(recorded.read_text()))
        return dataclasses.replace(prepared, task=pipeline.TaskFiles(**prepared.task)), None
    started = time.time()
    prepared = pipeline.prepare(
        prepare_dir, task_config, log_path=os.path.join(workdir, "sft.log"), fp32=precision == "fp32"
    )
    recorded.write_text(json.dumps(dataclasses.asdict(prepared)))
    return prepared, time.time() - started


def open_document(options, path):
    """The study so far in ``path``, refused if it was run with another protocol (one --out holds one study)."""
    empty = {"protocol": protocol(options), "tasks": {}, "runs": []}
    document = json.loads(Path(path).read_text()) if os.path.exists(path) else empty
    mine = protocol(options)
    for key in PROTOCOL:
        theirs = document["protocol"].get(key, LEGACY_PROTOCOL.get(key))
        if theirs != mine[key]:
            raise SystemExit(f"{path} holds a study with {key} {theirs}; give another --out")
    return document


def save(document, path):
    Path(path).write_text(json.dumps(document, indent=1))


def weights_digest(model_dir):
    """sha256 of a model's safetensors files: the warm start's identity, whichever machine or workdir made it."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model_dir} holds no *.safetensors: not a warm start bench_speed.py can identify")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def prepare(options, task, document, workdir, path):
    """The task's warm start (its SFT, made once per task config in ``workdir``) and, before the task's first run,
    its held-out greedy accuracy and thresholds in ``document``. Once runs are recorded the warm start is theirs: one
    found in ``workdir`` or made there anew (a fresh machine) is taken only with the same weights, or, for a task
    recorded before their digest was kept, the same held-out greedy accuracy (the digest is then kept)."""
    config = pipeline.task_config(task, **task_overrides(options))
    if options.steps * options.prompts > config.n_prompts:  # the fresh regime's one pass
        raise SystemExit(f"--steps {options.steps} x --prompts {options.prompts} exceed {config.n_prompts} RL prompts")
    split = f"-sft{config.n_sft}x{config.sft_epochs}-prompts{config.n_prompts}-heldout{config.n_heldout}"
    recorded = any(run["task"] == task for run in document["runs"])
    prepared, sft_seconds = prepare_task(task, options.precision, config, workdir, split)
    digest = weights_digest(prepared.sft_model)
    entry = document["tasks"].get(task)
    if not recorded:  # a warm start other than the entry's, if any, replaces it: no run reads its thresholds yet
        if entry is None or sft_seconds is not None or entry.get("sft_digest") != digest:
            entry = document["tasks"][task] = dict(
                task_config=dataclasses.asdict(config),
                warm_start=warm_start_accuracy(options, task, prepared),
                sft_seconds=sft_seconds,
                date=time.strftime("%Y-%m-%d"),
            )
            entry["thresholds"] = thresholds(entry["warm_start"]["greedy"], options.fractions)
            print(f"{task}: warm start held-out greedy {entry['warm_start']['greedy']:.3f}", flush=True)
    elif entry is None:
        raise SystemExit(f"{path} holds runs of {task} but not their warm start and thresholds: give another --out")
    else:
        reproduced = (
            entry["sft_digest"] == digest
            if "sft_digest" in entry
            else warm_start_accuracy(options, task, prepared) == entry["warm_start"]
        )
        if not reproduced:
            raise SystemExit(
                f"{path} holds runs of {task} from another warm start than the one in {workdir} (found there or made "
                "there anew, its weights or held-out accuracy differ): give the --workdir of those runs, or another "
                "--out"
            )
        if sft_seconds is not None:  # made again: its time counts in the study's duration
            entry.setdefault("sft_remade", []).append(dict(date=time.strftime("%Y-%m-%d"), sft_seconds=sft_seconds))
    entry["sft_digest"] = digest
    save(document, path)
    return prepared


def warm_start_accuracy(options, task, prepared):
    return evaluate.heldout_accuracy(
        prepared.sft_model,
        prepared.task.heldout,
        seed=0,
        task=task,
        max_new_tokens=prepared.max_new_tokens,
        samples=options.eval_samples,
    )


def recorded(document, task, regime, arm, lr, seed, rerun=False):
    """Whether the run (a rerun, with ``rerun``) is in ``document``."""
    return any(
        (run["task"], run["regime"], run["arm"], run["seed"]) == (task, regime, arm, seed)
        and math.isclose(run["lr"], lr, rel_tol=1e-9)
        and (run["phase"] == "rerun") == rerun
        for run in document["runs"]
    )


def generated_tokens(step):
    """The response tokens one logged step generated: every rollout (filtered groups included) where D3S counted
    them, else the trained ones."""
    return step.get("d3s/generated_tokens", step["rollout/response_length_mean"] * step["rollout/num_samples"])


def record(result, task, regime, arm, lr, seed, phase, warm_start):
    """One run as the JSON keeps it, what the report reads: its settings, durations, the held-out curve with its three
    clocks (the warm start first, at step 0) and the totals of its steps (``SUMMED``, the generated tokens)."""
    steps = result["steps"]
    wall, generated, clocks = 0.0, 0.0, []  # the two clocks after each step
    for step in steps:
        wall, generated = wall + step["timing/step_total"], generated + generated_tokens(step)
        clocks.append((wall, generated))
    curve = [dict(step=0, wall=0.0, generated=0.0, greedy=warm_start)] + [
        {**e, "wall": clocks[e["step"] - 1][0], "generated": clocks[e["step"] - 1][1]} for e in result["heldout"]
    ]
    return dict(
        task=task,
        regime=regime,
        arm=arm,
        lr=lr,
        seed=seed,
        phase=phase,
        date=time.strftime("%Y-%m-%d"),
        machine=f"{cpu_model()}, {os.cpu_count()} CPUs",
        group=result["group"],
        flags=[str(flag) for flag in ARMS[arm][1]],
        process_seconds=result["process_seconds"],
        eval_seconds=result["eval_seconds"],
        stopped=result["stopped"],
        curve=curve,
        totals=dict(
            steps=len(steps), **{key: float(sum(s.get(key, 0.0) for s in steps)) for key in SUMMED}, generated=generated
        ),
    )


def run_one(options, prepared, document, path, workdir, key, phase):
    """Run ``key`` = (task, regime, arm, lr, seed) unless it is recorded; append it to ``document`` and save."""
    task, regime, arm, lr, seed = key
    if recorded(document, *key, rerun=phase == "rerun"):
        return
    n_prompts = document["tasks"][task]["task_config"]["n_prompts"]
    result = run(
        prepared[task],
        task,
        arm,
        seed,
        os.path.join(workdir, task_dir_name(task), *(["rerun"] if phase == "rerun" else [])),
        options.steps,
        options.eval_every,
        options.eval_samples,
        options.prompts,
        options.precision == "fp32",
        regime=regime,
        pool=options.pool if regime == "passes" else n_prompts,
        lr=lr,
        cap=options.run_cap,
        eval_early=options.eval_early,
        micro_batch=options.micro_batch,
    )
    warm_start = document["tasks"][task]["warm_start"]["greedy"]
    entry = record(result, task, regime, arm, lr, seed, phase, warm_start)
    document["runs"].append(entry)
    save(document, path)
    stopped = (
        f" (stopped at the {options.run_cap:.0f} s cap after step {len(result['steps'])})" if entry["stopped"] else ""
    )
    print(
        f"{task} {regime} {arm} lr {lr:g} seed {seed} ({phase}): held-out greedy {entry['curve'][-1]['greedy']:.3f}"
        f"{stopped}; run {result['process_seconds']:.0f}s + eval {result['eval_seconds']:.0f}s",
        flush=True,
    )


def regimes_of(options, task):
    return [regime for regime in options.regimes if regime in TASKS.get(task, REGIMES)]


def chosen_lr(options, document, task, regime, arm):
    """The arm's rate from its complete sweep (every --lrs on every --sweep-seeds, and GRPO at the reference rate
    for the budget); refused while a run of it is missing."""
    needed = [(arm, lr) for lr in options.lrs] + [("GRPO", REFERENCE_LR)]
    missing = [
        f"{a} lr {lr:g} seed {seed}"
        for a, lr in needed
        for seed in options.sweep_seeds
        if not recorded(document, task, regime, a, lr, seed)
    ]
    analysed = regime_analysis(document, task, regime)
    # the report's rule: every (lr, seed) that any arm of this task and regime swept (an earlier --lrs included)
    missing += [f"{arm} lr {lr:g} seed {seed}" for lr, seed in analysed["incomplete"].get(arm, ())]
    if missing:
        raise SystemExit(
            f"the study of {arm} ({task}, {regime}) needs its sweep first (--phases sweep); missing: "
            + ", ".join(dict.fromkeys(missing))
        )
    return analysed["chosen"][arm]


def main(argv=None):
    options = parse_options(argv)
    out = os.path.abspath(options.out)
    workdir = os.path.abspath(options.workdir or os.path.join(out, "speed_runs"))
    path = os.path.join(out, f"{options.name}.json")
    document = open_document(options, path)
    for directory in (out, workdir):
        os.makedirs(directory, exist_ok=True)
    started = time.time()
    prepared = {task: prepare(options, task, document, workdir, path) for task in options.tasks}
    cells = [
        (task, regime, arm) for task in options.tasks for regime in regimes_of(options, task) for arm in options.arms
    ]
    if "sweep" in options.phases:  # seed-major: a drift of the machine's speed hits every arm and rate alike
        for seed in options.sweep_seeds:
            for task, regime, arm in cells:
                for lr in options.lrs:
                    run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "sweep")
    if "study" in options.phases:
        for seed in options.seeds:
            for task, regime, arm in cells:
                lr = chosen_lr(options, document, task, regime, arm)
                run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "study")
    if "rerun" in options.phases:
        for seed in options.rerun_seeds:
            for task, regime, arm in cells:
                lr = chosen_lr(options, document, task, regime, arm)
                run_one(options, prepared, document, path, workdir, (task, regime, arm, lr, seed), "rerun")
    if FIXED_RATE in options.phases:
        for seed in options.seeds:
            for task, regime, arm in cells:
                run_one(
                    options, prepared, document, path, workdir, (task, regime, arm, options.fixed_lr, seed), FIXED_RATE
                )
    report = f"benchmarks/report.py --speed {path} --output {os.path.join(out, options.name + '.md')}"
    print(f"wrote {path} ({time.time() - started:.0f}s); its report alone: .venv/bin/python {report}", flush=True)
    return path


if __name__ == "__main__":
    main()
